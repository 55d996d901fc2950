"""The kubeinfer operator (kopf)."""
