"""What the benchmarks share: percentiles, the deployed app as users run it, tables.

Every benchmark prints its results as a Markdown table (`table`), so that
docs/performance.md can take it as it is.
"""

import contextlib
import math
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "tests")) if p not in sys.path]


def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of xs by nearest rank; nan when xs is empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def ms(xs: Sequence[float], q: float) -> str:
    """The q-quantile of seconds `xs`, in whole milliseconds ('-' when empty)."""
    return f"{1e3 * pct(xs, q):.0f}" if xs else "-"


def table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table; floats with 3 significant digits."""
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def deployed_app(engine_overrides: Optional[dict] = None):
    """`serve run deploy/app.yaml` as shipped, only its HTTP port moved to a free one on
    loopback (and any `engine_overrides` set in its engine config); yields the base URL."""
    from serve_fixtures import free_port, serve_run  # tests/serve_fixtures.py

    cfg = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())
    cfg["applications"][0]["args"]["engine"].update(engine_overrides or {})
    port = free_port()
    cfg["http_options"] = {**cfg["http_options"], "host": "127.0.0.1", "port": port}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "app.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with serve_run(path, port, ROOT) as base:
            yield base
