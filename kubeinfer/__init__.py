"""kubeinfer: LLM inference on Kubernetes.

The distribution maps its top-level folders into this namespace: `runtime/` is
`kubeinfer.runtime`, `kernels/` is `kubeinfer.kernels`, `operator/` is `kubeinfer.operator`,
`devcluster/` is `kubeinfer.devcluster`.
"""

__version__ = "0.1.0"
