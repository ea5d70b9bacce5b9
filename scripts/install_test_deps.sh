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

# 1. verl's config files in this environment, for `ppotune export --validate-verl` (no verl imports needed).
if pip install -q --no-deps verl==0.9.1; then status verl-configs ok; else status verl-configs "unavailable: pip install --no-deps verl==0.9.1 failed"; fi
