//go:build tools

// Package tools keeps the control-plane commands in this module's graph, so `go mod tidy`
// records every dependency they need and `go build` can build them from the module cache.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
