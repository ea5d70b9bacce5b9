"""docs/gpu.md's inventory of CUDA-only branches (scripts/gen_cuda_inventory.py): every CUDA-only call site of trainer/
and tuner/ is listed with the CPU test that proves its semantics, no rollout, memory-reading, offload or cap site
says "none", every proof names a test that exists, and the page is what the script writes now."""

import ast
import importlib.util
import sys

from support import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cuda_inventory", REPO / "scripts" / "gen_cuda_inventory.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclass looks its module up
    spec.loader.exec_module(gen)
    return gen


GEN = _generator()


def _test_names(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_cuda_only_call_site_has_an_entry_and_every_entry_a_site():
    where = {s.where for s in GEN.sites()}
    missing = sorted(where - GEN.PROOFS.keys())
    stale = sorted(GEN.PROOFS.keys() - where)
    assert not missing, f"CUDA-only call sites with no proof in scripts/gen_cuda_inventory.py PROOFS: {missing}"
    assert not stale, f"PROOFS entries whose function has no CUDA-only call any more: {stale}"


def test_rollout_memory_offload_and_cap_sites_are_each_proven():
    unproven = [
        s.where
        for s in GEN.sites()
        if set(GEN.kinds_of(s)) & set(GEN.PROVEN_KINDS) and GEN.PROOFS.get(s.where, "").startswith(GEN.NONE)
    ]
    assert not unproven, f"these paths need a CPU proof of their CUDA semantics, not 'none': {unproven}"


def test_every_named_proof_exists():
    bad = []
    for where, proof in GEN.PROOFS.items():
        if proof.startswith(GEN.NONE):
            assert len(proof) > len(GEN.NONE) + 10, f"{where}: 'none' needs its reason"
            continue
        for ref in proof.split(","):
            path, _, name = ref.strip().partition("::")
            file = REPO / path
            if not file.is_file() or name not in _test_names(file):
                bad.append(f"{where}: {ref.strip()}")
    assert not bad, "proofs naming no existing test:\n" + "\n".join(bad)


def test_the_finder_sees_each_kind_of_cuda_only_call(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "tuner").mkdir()
    (tmp_path / "trainer" / "m.py").write_text(
        "import torch\n"
        "def a(d):\n    torch.cuda.synchronize(d)\n"
        "class K:\n    def b(self, t):\n        return t.pin_memory() if t.device.type == 'cuda' else t\n"
        "def c(device_type):\n    return device_type != 'cuda'\n"
        "def d():\n    return 1\n"
    )
    (tmp_path / "tuner" / "n.py").write_text("import pynvml\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n")
    found = {s.where: s.calls for s in GEN.sites(tmp_path)}
    assert found == {
        "trainer/m.py::a": ("torch.cuda.synchronize",),
        "trainer/m.py::K.b": ('.pin_memory', '.type == "cuda"'),
        "trainer/m.py::c": ('device_type == "cuda"',),
        "tuner/n.py::<module>": ("pynvml.nvmlDeviceGetHandleByIndex",),
    }


def test_gpu_md_inventory_is_the_code():
    text = GEN.PAGE.read_text()
    assert GEN.updated(text) == text, "docs/gpu.md's inventory is out of date: run python scripts/gen_cuda_inventory.py"
