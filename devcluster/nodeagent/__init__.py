"""The dev node agent: the dev cluster's stand-in for the kubelet, running pods as local
processes on loopback addresses."""
