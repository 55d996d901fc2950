"""The `kubeinfer` command: one typer app, each component adds its own sub-commands."""

from __future__ import annotations

import typer

from kubeinfer.operator.cli import app as operator_app
from kubeinfer.router.cli import register as register_router
from kubeinfer.runtime.cli import register as register_runtime

app = typer.Typer(help="kubeinfer: LLM inference on Kubernetes.", no_args_is_help=True)
try:  # a checkout's editable install only: the wheel leaves the dev cluster out (setup.py)
    from kubeinfer.devcluster.cli import app as dev_app
except ModuleNotFoundError as e:
    if e.name not in ("kubeinfer.devcluster", "kubeinfer.devcluster.cli"):
        raise
else:
    app.add_typer(dev_app, name="dev", help="The dev cluster: a real control plane on one machine.")
app.add_typer(operator_app, name="operator", help="The InferenceModel operator (kopf).")
register_runtime(app)
register_router(app)


@app.command()
def version() -> None:
    """Print kubeinfer's version."""
    from kubeinfer import __version__

    typer.echo(__version__)
