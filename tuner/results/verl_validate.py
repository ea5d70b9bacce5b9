"""Check exported overrides against verl's own ``ppo_trainer`` config, without running verl.

verl's config is a Hydra tree (``verl/trainer/config/ppo_trainer.yaml`` plus groups).
Composing it with our overrides through ``hydra.compose`` is exactly what
``python -m verl.trainer.main_ppo key=value ...`` does first, so an unknown key fails
here the way it would fail there. Hydra does not type-check an untyped tree, so the
value types are checked separately: against the field annotation of the dataclass the
node instantiates (its ``_target_``, read statically from verl's source — importing
``verl`` pulls in Ray), else against the type of verl's default value.

No Ray, no GPU, no import of ``verl`` itself: only its config files and source are read, from the first of
``$PPOTUNE_VERL_ROOT`` (a directory of verl's package, e.g. unpacked from its wheel: scripts/install_test_deps.sh
does that for the tests, so verl never has to be installed, without its dependencies, beside ours), the verl of an
interpreter the user names (``export --engine-python``), or this interpreter's verl.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

__all__ = ["VERL_ROOT_ENV", "VerlNotInstalled", "VerlOverrideError", "verl_root", "validate_overrides"]

#: A directory holding verl's package (the one with ``trainer/config/ppo_trainer.yaml``, or its parent).
VERL_ROOT_ENV = "PPOTUNE_VERL_ROOT"
_CONFIG = ("trainer", "config", "ppo_trainer.yaml")
_NO_VERL = (
    f"verl's config files not found: set {VERL_ROOT_ENV} to verl's package directory, or pass the "
    "interpreter of your verl environment (export --engine-python PY)"
)


class VerlNotInstalled(RuntimeError):
    pass


class VerlOverrideError(ValueError):
    """An override verl would refuse (unknown key) or misread (wrong type). Names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def verl_root(python: Optional[str] = None) -> Optional[Path]:
    """verl's package directory, found without importing verl (its ``__init__`` imports Ray): ``$PPOTUNE_VERL_ROOT``,
    else the verl of ``python`` (an interpreter the user passed; asked with ``find_spec``, which imports nothing),
    else this interpreter's. None when none of them has verl's config files."""
    env = os.environ.get(VERL_ROOT_ENV)
    if env:
        for d in (Path(env).resolve(), Path(env).resolve() / "verl"):  # Hydra takes absolute config dirs only
            if d.joinpath(*_CONFIG).is_file():
                return d
        return None
    if python:
        return _root_in(python)
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


_FIND = (
    "import importlib.util as u; s = u.find_spec('verl'); "
    "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
)


@functools.lru_cache(maxsize=None)
def _root_in(python: str) -> Optional[Path]:
    """verl's package directory in another environment (``python``'s), or None."""
    try:
        r = subprocess.run([python, "-c", _FIND], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = r.stdout.strip()
    return Path(line) if r.returncode == 0 and line and Path(line).joinpath(*_CONFIG).is_file() else None


def _config_dir(python: Optional[str] = None) -> Path:
    root = verl_root(python)
    if root is None or not root.joinpath(*_CONFIG).is_file():
        raise VerlNotInstalled(_NO_VERL)
    return root / "trainer" / "config"


def _compose(config_dir: Path, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # compose needs a GlobalHydra; a caller's own one would point at another config dir
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


_KEY_IN_MESSAGE = re.compile(r"(?:override|Key) '([^']+)'")


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.strip().lstrip("+~"), value


def validate_overrides(overrides: list[str], *, python: Optional[str] = None) -> dict[str, Any]:
    """Compose verl's ``ppo_trainer`` config with ``overrides`` (``key=value`` strings).

    Returns {key: the value verl would see}. Raises :class:`VerlOverrideError` naming
    the first key that verl does not have or whose value has the wrong type, and
    :class:`VerlNotInstalled` when verl's config files are not found (:func:`verl_root`; ``python``: the
    interpreter of the user's verl environment).
    """
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config_dir = _config_dir(python)
    try:
        cfg = _compose(config_dir, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        key = _offending_key(config_dir, overrides, e)
        first = str(e).strip().splitlines()[0]
        raise VerlOverrideError(key, f"verl's ppo_trainer config refuses it ({first})") from None
    base = _compose(config_dir, [])

    last = dict(_split(o) for o in overrides)  # Hydra applies them in order: the last one wins
    seen = {}
    for key, raw in last.items():
        new = OmegaConf.select(cfg, key, throw_on_missing=False)
        if OmegaConf.is_config(new):
            new = OmegaConf.to_container(new, resolve=False)
        expected = _expected_types(base, key, config_dir.parent.parent)
        if expected is not None and not _matches(new, expected):
            names = " or ".join(sorted({"null" if t is type(None) else t.__name__ for t in expected}))
            raise VerlOverrideError(key, f"verl expects {names}, got {type(new).__name__} {raw!r}")
        seen[key] = new
    return seen


def _offending_key(config_dir: Path, overrides: list[str], error: Exception) -> str:
    m = _KEY_IN_MESSAGE.search(str(error))
    if m:
        return m.group(1)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:  # find it the slow way: one override at a time
        try:
            _compose(config_dir, [override])
        except (HydraException, OmegaConfBaseException):
            return _split(override)[0]
    return "<overrides>"


# --------------------------------------------------------------------------- types
def _expected_types(base, key: str, root: Path) -> Optional[set]:
    """The types verl accepts at ``key``: the dataclass annotation, else its default's type."""
    from omegaconf import OmegaConf

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(base, parent_key) if parent_key else base
    if parent is None or not OmegaConf.is_dict(parent):
        return None
    target = parent.get("_target_") if "_target_" in parent else None
    if isinstance(target, str):
        ann = _annotation(target, leaf, root)
        if ann is not None:
            return ann
    try:
        default = OmegaConf.select(base, key, throw_on_missing=False)
    except Exception:  # an interpolation verl resolves only at run time
        return None
    if default is None:
        return None  # null default, no annotation: anything goes
    if isinstance(default, bool):
        return {bool}
    if isinstance(default, int):
        return {int}
    if isinstance(default, float):
        return {float}
    if isinstance(default, str):
        return {str}
    if OmegaConf.is_list(default):
        return {list}
    if OmegaConf.is_dict(default):
        return {dict}
    return None


def _matches(value: Any, expected: set) -> bool:
    if value is None:
        return type(None) in expected
    if isinstance(value, bool):
        return bool in expected
    if isinstance(value, int):
        return int in expected or float in expected
    if isinstance(value, float):
        return float in expected
    return any(isinstance(value, t) for t in expected if t not in (bool, int, float, type(None)))


@functools.lru_cache(maxsize=None)
def _classes_in(package_dir: str) -> dict[str, tuple[list[str], dict[str, ast.expr]]]:
    """{class name: (base names, {field: annotation})} for every class in a package's files."""
    out: dict = {}
    d = Path(package_dir)
    files = sorted(d.glob("*.py")) if d.is_dir() else [d.with_suffix(".py")]
    for f in files:
        try:
            tree = ast.parse(f.read_text())
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                fields = {
                    s.target.id: s.annotation
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                out.setdefault(node.name, (bases, fields))
    return out


def _annotation(target: str, field: str, root: Path) -> Optional[set]:
    module, _, cls = target.rpartition(".")
    if not module.startswith("verl."):
        return None
    package = root.parent.joinpath(*module.split("."))
    classes = _classes_in(str(package))
    seen = set()
    while cls in classes and cls not in seen:
        seen.add(cls)
        bases, fields = classes[cls]
        if field in fields:
            return _types_of(fields[field])
        cls = next((b for b in bases if b in classes), "")
    return None


_NAMES = {
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "list": list,
    "List": list,
    "tuple": list,
    "Tuple": list,
    "Sequence": list,
    "dict": dict,
    "Dict": dict,
    "Mapping": dict,
}


def _types_of(ann: ast.expr) -> Optional[set]:
    """An annotation AST -> the set of Python types it admits; None when unsure (Any, classes)."""
    if isinstance(ann, ast.Constant):
        if ann.value is None:
            return {type(None)}
        if isinstance(ann.value, str):  # a string annotation
            try:
                return _types_of(ast.parse(ann.value, mode="eval").body)
            except SyntaxError:
                return None
        return None
    if isinstance(ann, (ast.Name, ast.Attribute)):
        name = ann.id if isinstance(ann, ast.Name) else ann.attr
        t = _NAMES.get(name)
        return {t} if t else None
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        left, right = _types_of(ann.left), _types_of(ann.right)
        return left | right if left is not None and right is not None else None
    if isinstance(ann, ast.Subscript):
        head = ann.value.id if isinstance(ann.value, ast.Name) else getattr(ann.value, "attr", "")
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            inner = _types_of(args[0])
            return inner | {type(None)} if inner is not None else None
        if head == "Union":
            parts = [_types_of(a) for a in args]
            return set().union(*parts) if all(p is not None for p in parts) else None
        if head == "Literal":
            return {type(a.value) for a in args if isinstance(a, ast.Constant)} or None
        t = _NAMES.get(head)
        return {t} if t else None
    return None
