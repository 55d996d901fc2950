"""The dev cluster: a real Kubernetes control plane and a node agent on one machine."""
