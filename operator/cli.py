"""`kubeinfer operator ...`: run the operator, or print what it would create for a model."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="The InferenceModel operator (kopf).")


@app.command()
def run(
    namespace: list[str] = typer.Option(
        [], "--namespace", "-n", help="Watch this namespace (repeat); default: all, or env."
    ),
    log_level: str | None = typer.Option(None, help="debug | info | warning | error"),
) -> None:
    """Run the operator until SIGINT/SIGTERM (settings from KUBEINFER_OPERATOR_* env)."""
    from kubeinfer.operator.main import configure_logging, run_operator
    from kubeinfer.operator.settings import OperatorSettings

    overrides: dict[str, object] = {}
    if namespace:
        overrides["namespaces"] = namespace
    if log_level:
        overrides["log_level"] = log_level
    settings = OperatorSettings(**overrides)  # type: ignore[arg-type]
    configure_logging(settings.log_level)
    asyncio.run(run_operator(settings))


@app.command()
def render(
    file: Path = typer.Option(..., "--file", "-f", help="An InferenceModel YAML ('-': stdin)."),
    namespace: str = typer.Option("default", "--namespace", "-n"),
) -> None:
    """Print what the operator would apply (Deployment, Service, PDB, router or InferencePool),
    as JSON lines."""
    import yaml

    from kubeinfer.operator.manifests import render as render_manifests
    from kubeinfer.operator.settings import OperatorSettings
    from kubeinfer.operator.spec import InvalidSpecError

    text = sys.stdin.read() if str(file) == "-" else file.read_text()
    model = yaml.safe_load(text)
    model.setdefault("metadata", {}).setdefault("namespace", namespace)
    model["metadata"].setdefault("uid", "00000000-0000-0000-0000-000000000000")
    try:
        manifests = render_manifests(model, OperatorSettings())
    except InvalidSpecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for manifest in manifests:
        typer.echo(json.dumps(manifest))
