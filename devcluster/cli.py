"""`kubeinfer dev ...` sub-commands: up, down, status, logs, kubeconfig."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True)
console = Console()

STATE_DIR = typer.Option(
    None,
    "--state-dir",
    envvar="KUBEINFER_DEV_DIR",
    help="the cluster's state folder (default .cache/dev)",
)


def _cluster(state_dir: Path | None, num_nodes: int | None = None):  # type: ignore[no-untyped-def]
    from kubeinfer.devcluster.cluster import DevCluster

    return DevCluster.from_env(state_dir, num_nodes)


@app.command()
def up(
    state_dir: Path | None = STATE_DIR,
    nodes: int = typer.Option(2, "--nodes", min=1, max=16, help="number of fake GPU nodes"),
) -> None:
    """Start the dev cluster (or whatever part of it is not running) and wait until it serves."""
    from kubeinfer.devcluster.config import DevClusterError

    cluster = _cluster(state_dir, nodes)
    start = time.monotonic()
    try:
        state = cluster.up(progress=lambda msg: console.print(f"[dim]-->[/] {msg}"))
    except DevClusterError as exc:
        console.print(f"[red]dev up failed:[/] {exc}")
        raise typer.Exit(1) from exc
    kubectl = Path(state.bin_dir) / "kubectl"
    console.print(
        f"dev cluster {state.kubernetes_version} up in {time.monotonic() - start:.1f}s\n"
        f"  export KUBECONFIG={cluster.kubeconfig}\n"
        f"  {kubectl} get nodes\n"
        f"  kubeinfer dev logs POD       # a pod's container logs\n"
        f"  kubeinfer dev down           # stop everything"
    )


@app.command()
def down(
    state_dir: Path | None = STATE_DIR,
    purge: bool = typer.Option(False, "--purge", help="also delete etcd data, certs and logs"),
) -> None:
    """Stop every process `dev up` started, pods included."""
    _cluster(state_dir).down(purge=purge, progress=lambda msg: console.print(f"[dim]-->[/] {msg}"))
    console.print("dev cluster down")


@app.command()
def status(state_dir: Path | None = STATE_DIR) -> None:
    """Show each component: pid, running, healthy."""
    table = Table("component", "pid", "running", "healthy", "detail")
    rows = _cluster(state_dir).status()
    for row in rows:
        table.add_row(
            row.name, str(row.pid or "-"), _yes(row.is_running), _yes(row.is_healthy), row.detail
        )
    console.print(table)
    if not all(r.is_healthy for r in rows):
        raise typer.Exit(1)


@app.command()
def logs(
    pod: str = typer.Argument(..., help="pod name"),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    container: str | None = typer.Option(None, "-c", "--container"),
    follow: bool = typer.Option(False, "-f", "--follow", help="keep printing new lines"),
    state_dir: Path | None = STATE_DIR,
) -> None:
    """Print a pod's container logs (from .cache/dev/pods/NAMESPACE_POD_CONTAINER.log)."""
    pods_dir = _cluster(state_dir).layout.root / "pods"
    pattern = f"{namespace}_{pod}_{container}.log" if container else f"{namespace}_{pod}_*.log"
    files = sorted(pods_dir.glob(pattern))
    if not files:
        console.print(f"[red]no logs for pod {namespace}/{pod}[/] in {pods_dir}")
        raise typer.Exit(1)
    for path in files:
        if len(files) > 1:
            console.print(f"[bold]==> {path.name} <==[/]")
        sys.stdout.write(path.read_text(errors="replace"))
    if follow:
        _follow(files)


def _follow(files: list[Path]) -> None:
    offsets = {p: p.stat().st_size for p in files}
    try:
        while True:
            for path, offset in offsets.items():
                size = path.stat().st_size
                if size > offset:
                    with open(path, errors="replace") as f:
                        f.seek(offset)
                        sys.stdout.write(f.read())
                    sys.stdout.flush()
                    offsets[path] = size
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


@app.command()
def kubeconfig(state_dir: Path | None = STATE_DIR) -> None:
    """Print the path of the dev cluster's kubeconfig."""
    typer.echo(str(_cluster(state_dir).kubeconfig))


def _yes(value: bool) -> str:
    return "[green]yes[/]" if value else "[red]no[/]"
