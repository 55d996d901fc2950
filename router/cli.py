"""`kubeinfer router`: the model's endpoint, an LLM-aware proxy in front of its pods."""

from __future__ import annotations

import logging
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add `router` to the root app."""
    app.command()(router)


def router(
    backend: list[str] | None = typer.Option(
        None, "--backend", help="Backend base URL, http://HOST:PORT (repeatable)."
    ),
    backends_file: Path | None = typer.Option(
        None, help="File of backend URLs, one a line, re-read every discovery interval."
    ),
    selector: str | None = typer.Option(None, help="Label selector of the model's pods."),
    namespace: str | None = typer.Option(None, help="Namespace of the pods (with --selector)."),
    pod_port: int | None = typer.Option(None, help="The pods' port (default 8000)."),
    model_name: str | None = typer.Option(None, help="Count only this model in pod metrics."),
    host: str | None = typer.Option(None, help="Address to bind (default 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default 8000)."),
    discovery_interval_s: float | None = typer.Option(None, help="Backend list refresh, s."),
    scrape_interval_s: float | None = typer.Option(None, help="Pod /metrics scrape period, s."),
    scrape_timeout_s: float | None = typer.Option(None, help="One scrape's bound, s."),
    prefix_chars: int | None = typer.Option(None, help="Prompt characters in the prefix key."),
    affinity_keys: int | None = typer.Option(None, help="Prefix/session keys remembered."),
    balance_factor: float | None = typer.Option(None, help="Bounded-load factor (>= 1)."),
    kv_weight: float | None = typer.Option(None, help="Score of a full KV cache, in requests."),
    kv_saturation: float | None = typer.Option(None, help="KV usage that affinity avoids."),
    stale_penalty: float | None = typer.Option(None, help="Score of a stale pod, in requests."),
    max_held_requests: int | None = typer.Option(None, help="Requests held at zero pods."),
    max_hold_s: float | None = typer.Option(None, help="Longest hold before 503, s."),
    retry_after_s: int | None = typer.Option(None, help="Retry-After of the router's 503s."),
    max_request_bytes: int | None = typer.Option(None, help="Largest request body."),
    max_connect_retries: int | None = typer.Option(None, help="Other pods tried on refusal."),
    connect_timeout_s: float | None = typer.Option(None, help="Connect bound per pod, s."),
    upstream_timeout_s: float | None = typer.Option(None, help="Longest wait between bytes, s."),
    max_connections: int | None = typer.Option(None, help="Connections to the pods in all."),
    drain_timeout_s: float | None = typer.Option(None, help="SIGTERM: time to finish, s."),
    log_level: str | None = typer.Option(None, help="debug | info | warning | error"),
) -> None:
    """Route the OpenAI API to a model's pods. Every option also reads KUBEINFER_ROUTER_<OPTION>."""
    given = {k: v for k, v in locals().items() if v is not None and k != "backend"}
    if backend:
        given["backends"] = list(backend)
    from pydantic import ValidationError

    from kubeinfer.router.serve import serve
    from kubeinfer.router.settings import RouterSettings

    try:
        settings = RouterSettings(**given)
    except ValidationError as e:
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"])
            flag = f"--{where.replace('_', '-')}: " if where else ""
            typer.echo(f"error: {flag}{err['msg']}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    serve(settings)
