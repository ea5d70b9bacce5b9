"""What :mod:`trainer.verl_engine.plugin` wraps in verl, checked in verl's source before anything is patched.

The plugin wraps verl functions by name (:data:`ENTRY_POINTS`: the worker's and the driver's ``PATCHES``). Another
verl than the one they are read from may have moved, renamed or re-shaped one: the wrapper would then find nothing
to wrap (a trial measures less, and an in-run sweep replays nothing) or call it with the wrong arguments. So at
start-up the plugin reads verl's source with :mod:`ast` (no verl module beyond the package is imported: the hook
loads the CPU shim first, and verl's workers must not be imported before it has registered its platform) and
refuses a verl that lacks one, in one line naming verl's version and each missing piece.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = [
    "EntryPoint",
    "ENTRY_POINTS",
    "TESTED_VERSIONS",
    "entry_point_gaps",
    "refusal",
    "imported_verl_dir",
    "verl_version",
]

#: the verl versions whose source the entry points are read from, and that the tests run (docs/verl.md lists them)
TESTED_VERSIONS = ("0.9.1",)


@dataclass(frozen=True)
class EntryPoint:
    """A name in a verl module the plugin wraps, and the leading parameters its wrapper passes by name/position."""

    module: str  # where the plugin patches it (a name imported there is followed to its definition)
    name: str  # "function" or "Class.method"
    params: tuple = ()  # the wrapper binds these, in this order, as the first parameters
    exact: bool = False  # the wrapper passes only ``params``: no other parameter may lack a default

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"

    def expected(self) -> str:
        return f"({', '.join(self.params)}{'' if self.exact else ', ...'})"


_SAMPLER_MODULES = (
    "verl.trainer.ppo.utils",  # where create_rl_sampler is defined; the others import it by name
    "verl.trainer.ppo.ray_trainer",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.main_ppo_v0",
)

#: every verl entry point the plugin wraps (trainer.verl_engine.plugin.worker and .driver: PATCHES), as verl 0.9.1
#: defines it
ENTRY_POINTS: tuple = (
    EntryPoint("verl.workers.engine_workers", "TrainingWorker.infer_batch", ("self", "data")),
    EntryPoint("verl.workers.engine_workers", "TrainingWorker.train_mini_batch", ("self", "data")),
    EntryPoint("verl.workers.engine.fsdp.transformer_impl", "prepare_micro_batches"),  # its wrapper passes all on
    EntryPoint("verl.single_controller.ray.base", "func_generator", ("self", "method_name")),
    EntryPoint("verl.utils.tracking", "Tracking.log", ("self", "data", "step")),
    # the rollout's phases: each method an async def under auto_await, which the driver puts back around its timing
    *(
        EntryPoint("verl.checkpoint_engine.base", f"CheckpointEngineManager.{m}", ("self",))
        for m in ("update_weights", "sleep_replicas", "wake_up_replicas")
    ),
    EntryPoint("verl.checkpoint_engine.base", "auto_await", ("func",), exact=True),
    # the weight sync's socket, on both sides (plugin.worker.per_run_socket)
    EntryPoint("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter.__init__", ("self",)),
    EntryPoint("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension._get_zmq_handle", ("self",)),
    *(EntryPoint(m, "create_rl_sampler", ("data_config", "dataset"), exact=True) for m in _SAMPLER_MODULES),
)

_Def = Union[ast.FunctionDef, ast.AsyncFunctionDef]


def imported_verl_dir() -> Optional[Path]:
    """The directory of the ``verl`` package this process imports (its spec only: while the plugin runs, verl's
    ``__init__`` is still executing), or None without verl."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def verl_version(root: Path) -> str:
    """verl's version as its ``__init__`` reads it (``version/version`` beside it), else the installed metadata."""
    try:
        return (root / "version" / "version").read_text().strip()
    except OSError:
        pass
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source(root: Path, module: str) -> Optional[Path]:
    parts = module.split(".")[1:]  # under the package "verl"
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def _top_level(body: list) -> list:
    """A module's statements as they bind names at import: into ``if``/``try``/``with`` blocks, not into defs."""
    out = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _top_level(stmt.body) + _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _top_level(stmt.body) + _top_level(stmt.orelse) + _top_level(stmt.finalbody)
            for handler in stmt.handlers:
                out += _top_level(handler.body)
        elif isinstance(stmt, ast.With):
            out += _top_level(stmt.body)
    return out


def _imported_from(stmt: ast.ImportFrom, module: str, is_package: bool) -> Optional[str]:
    if not stmt.level:
        return stmt.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (stmt.level - 1)]
    return ".".join([*base, stmt.module] if stmt.module else base)


def _find(root: Path, module: str, name: str, depth: int = 0) -> tuple[Optional[ast.AST], str]:
    """The definition of ``name`` (a function or class) as ``module`` binds it, following ``from x import name``
    into verl; (None, why) when the module or the name is not there. A name imported from outside verl is
    (the import, "")."""
    path = _source(root, module)
    if path is None:
        return None, f"{module} is missing"
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError) as e:
        return None, f"{module} cannot be read ({type(e).__name__})"
    found: Optional[ast.AST] = None
    for stmt in _top_level(tree.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, ast.ImportFrom) and any((a.asname or a.name) == name for a in stmt.names):
            found = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = stmt
    if isinstance(found, ast.ImportFrom) and depth < 8:
        source = _imported_from(found, module, path.name == "__init__.py")
        original = next(a.name for a in found.names if (a.asname or a.name) == name)
        if source and (source == "verl" or source.startswith("verl.")):
            return _find(root, source, original, depth + 1)
        return found, ""
    return (found, "") if found is not None else (None, f"{module} has no {name}")


def _signature_gap(fn: _Def, ep: EntryPoint) -> Optional[str]:
    """Why ``fn``'s parameters do not take what the wrapper passes (None: they do)."""
    args = [*fn.args.posonlyargs, *fn.args.args]
    names = tuple(a.arg for a in args)
    required = len(args) - len(fn.args.defaults)
    kw_required = [a.arg for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is None]
    ok = names[: len(ep.params)] == ep.params or (len(names) < len(ep.params) and fn.args.vararg is not None)
    if ep.exact:
        ok = ok and required <= len(ep.params) and not kw_required
    if ok:
        return None
    return f"{ep} takes ({', '.join(names)}), the plugin passes {ep.expected()}"


def _check(root: Path, ep: EntryPoint) -> Optional[str]:
    """What is wrong with one entry point in the verl tree at ``root`` (None: nothing)."""
    owner, _, attr = ep.name.rpartition(".")
    node, why = _find(root, ep.module, owner or attr)
    if node is None:
        return why if owner else f"{why} ({ep})"
    if owner:
        if not isinstance(node, ast.ClassDef):
            return None  # a class bound another way (an assignment, an import from outside verl): not readable here
        node = next(
            (s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == attr), None
        )
        if node is None:
            return f"{ep.module}.{owner} has no method {attr}"
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ep.params:
        return None
    return _signature_gap(node, ep)


def entry_point_gaps(root: Path, entry_points: Sequence[EntryPoint] = ENTRY_POINTS) -> list[str]:
    """Each entry point the verl tree at ``root`` lacks, or has with parameters the plugin cannot call, in one
    phrase each (empty: the plugin can wrap them all)."""
    out = []
    for ep in entry_points:
        why = _check(root, ep)
        if why and why not in out:
            out.append(why)
    return out


#: the adapter keeps the last 300 characters of a failed run's error line (trainer.verl_engine.adapter.classify_failure)
_LINE_MAX = 300


def refusal(root: Optional[Path] = None) -> Optional[str]:
    """The one line the plugin refuses verl with (None: verl has what the plugin wraps): short enough to be a trial's
    error whole; the missing pieces that do not fit are counted."""
    root = root if root is not None else imported_verl_dir()
    if root is None:
        return None  # no verl to patch: nothing would be wrapped, and nothing run
    gaps = entry_point_gaps(root)
    if not gaps:
        return None
    head = (
        f"ppotune verl plugin error: verl {verl_version(root)} (ppotune is tested with verl "
        f"{', '.join(TESTED_VERSIONS)}) lacks what the plugin wraps: "
    )
    for shown in range(len(gaps), 0, -1):
        more = f"; and {len(gaps) - shown} more" if shown < len(gaps) else ""
        line = head + "; ".join(gaps[:shown]) + more
        if len(line) <= _LINE_MAX or shown == 1:
            return line
    return None  # unreachable: gaps is not empty
