//go:build tools

// Package tools keeps etcd's server (itself package main) in this module's graph.
package tools

import _ "go.etcd.io/etcd/server/v3"
