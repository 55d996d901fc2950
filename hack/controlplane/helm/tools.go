//go:build tools

// Package tools keeps helm's command in this module's graph.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
