"""`kubeinfer generate` (the engine and server issues add `serve`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kubeinfer.runtime.errors import KubeinferError
from kubeinfer.runtime.loadgen import loadgen

logger = logging.getLogger(__name__)


RUNTIME_MODULES = ("torch", "safetensors", "numpy")


def require_runtime() -> None:
    """Exit 2 with the install command when the `runtime` extra is missing: the operator's
    install (`pip install kubeinfer`, the operator image) has no torch."""
    import importlib

    missing = []
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        typer.echo(
            f"error: the inference runtime needs {', '.join(missing)}, which this install lacks: "
            "pip install 'kubeinfer[runtime]'",
            err=True,
        )
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    """Add the runtime's commands to the root app."""
    app.command()(generate)
    app.command()(serve)
    app.command()(loadgen)


def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Path = typer.Option(..., "--model", help="Model folder (HF format, safetensors)."),
    max_tokens: int = typer.Option(64, min=1, help="Most tokens to generate."),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16"),
    device: str = typer.Option("cpu", help="cpu | cuda | cuda:N"),
    chat: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
) -> None:
    """Generate a greedy completion of PROMPT with the engine, streamed to stdout."""
    require_runtime()
    if device.startswith("cpu"):
        from kubeinfer.runtime.malloc import reexec_with_tcmalloc

        reexec_with_tcmalloc()
    from kubeinfer.runtime.engine.config import EngineConfig
    from kubeinfer.runtime.engine.engine import Engine
    from kubeinfer.runtime.engine.sampling_params import SamplingParams
    from kubeinfer.runtime.loader import ProgressCallback

    logging.basicConfig(level=logging.WARNING)
    console = Console(stderr=True)
    columns = (TextColumn("loading"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("weights", total=None)
            on_progress: ProgressCallback = lambda done, total: progress.update(  # noqa: E731
                task, completed=done, total=total
            )
            engine = Engine(
                model,
                EngineConfig(max_num_seqs=1),
                dtype=dtype,
                device=device,
                on_progress=on_progress,
            )
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"{model}: no tokenizer.json, so no text prompts")
        if chat and tokenizer.chat_template:
            prompt_ids: str | list[int] = tokenizer.encode_chat(
                [{"role": "user", "content": prompt}]
            )
        else:
            prompt_ids = prompt
        engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        while engine.has_unfinished:
            for out in engine.step():
                sys.stdout.write(out.outputs[0].new_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    except (KubeinferError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None


def serve(
    model: Path | None = typer.Option(None, help="Model folder (HF format). Env: KUBEINFER_MODEL"),
    served_model_name: str | None = typer.Option(None, help="Name in /v1/models."),
    host: str | None = typer.Option(None, help="Address to bind (default 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default 8000)."),
    probe_port: int | None = typer.Option(
        None, help="Also serve /health, /ready, /metrics on this port, on their own thread."
    ),
    dtype: str | None = typer.Option(None, help="auto | float32 | bfloat16 | float16"),
    device: str | None = typer.Option(None, help="cpu | cuda | cuda:N"),
    max_model_len: int | None = typer.Option(None, help="Longest prompt + output."),
    max_num_seqs: int | None = typer.Option(None, help="Most sequences per step."),
    max_num_batched_tokens: int | None = typer.Option(None, help="Token budget per step."),
    num_kv_blocks: int | None = typer.Option(None, help="KV pool size in blocks."),
    kv_cache_memory_fraction: float | None = typer.Option(None, help="Share of memory for KV."),
    kv_cache_memory_bytes: int | None = typer.Option(None, help="CPU: KV byte budget."),
    enable_prefix_caching: bool | None = typer.Option(None, help="Reuse shared prefixes."),
    kernels: str | None = typer.Option(None, help="auto | torch | triton"),
    tensor_parallel_size: int | None = typer.Option(
        None, help="Devices one replica spans (tensor parallelism, a worker process per rank)."
    ),
    api_key: str | None = typer.Option(
        None,
        help="Require this bearer token on /v1/*.",
        envvar="KUBEINFER_API_KEY",
        show_envvar=False,
    ),
    max_request_bytes: int | None = typer.Option(
        None, help="Largest request body (default: from max_model_len)."
    ),
    max_input_chars: int | None = typer.Option(
        None, help="Most characters per prompt before tokenizing (default: 32 per token)."
    ),
    max_prompts_per_request: int | None = typer.Option(None, help="Prompts per request."),
    max_stop_strings: int | None = typer.Option(None, help="Stop strings per request."),
    max_stop_string_chars: int | None = typer.Option(None, help="Longest stop string."),
    max_stop_token_ids: int | None = typer.Option(None, help="stop_token_ids per request."),
    max_logit_bias: int | None = typer.Option(None, help="logit_bias entries per request."),
    max_chat_messages: int | None = typer.Option(None, help="Messages per chat request."),
    max_queued_requests: int | None = typer.Option(
        None, help="Waiting requests before 429 (default: 4 x max-num-seqs)."
    ),
    max_queued_tokens: int | None = typer.Option(
        None, help="Waiting prompt tokens before 429 (default: 16 x max-num-batched-tokens)."
    ),
    tokenizer_workers: int | None = typer.Option(None, help="Tokenizer threads."),
    engine_stall_timeout: float | None = typer.Option(
        None, help="/health fails after this many seconds without an engine step."
    ),
    shutdown_delay: float | None = typer.Option(
        None, help="SIGTERM: seconds to keep serving with /ready failing."
    ),
    drain_timeout: float | None = typer.Option(
        None, help="SIGTERM: seconds to finish in-flight requests."
    ),
    log_level: str | None = typer.Option(None, help="debug | info | warning | error"),
    metrics_fault_file: Path | None = typer.Option(
        None, help="Test hook: /metrics answers 503 while this file exists."
    ),
) -> None:
    """Serve the OpenAI API for one model. Every option also reads KUBEINFER_<OPTION>."""
    given = {k: v for k, v in locals().items() if v is not None}  # unset: env or default
    require_runtime()
    from pydantic import ValidationError

    from kubeinfer.runtime.server.serve import serve as run_server
    from kubeinfer.runtime.server.settings import ServerSettings

    try:
        settings = ServerSettings(**given)
    except ValidationError as e:
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"]) or "settings"
            typer.echo(f"error: --{where.replace('_', '-')}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    if settings.device.startswith("cpu"):
        from kubeinfer.runtime.malloc import reexec_with_tcmalloc

        reexec_with_tcmalloc()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_server(settings)
