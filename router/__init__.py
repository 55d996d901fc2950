"""The router: one model's endpoint, an LLM-aware HTTP proxy in front of its runtime pods.

`kubeinfer router` picks a pod for each request (`picker.pick`, pure: prefix and session
affinity on bounded-load consistent hashing, queue depth, KV usage), streams the answer back
unchanged, and holds requests while no pod is ready (scale from zero). It never imports torch.
"""
