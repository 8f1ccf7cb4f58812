#!/usr/bin/env bash
# Install a wheel into a fresh virtual environment and run what a new user would: import it,
# `flash-hopper info`, and the test suite against the installed package (not the source tree).
#
# Usage: tools/check_install.sh --wheel WHEEL [--python PYTHON] [--torch VERSION] [--venv DIR]
#          [--keep] [-- PYTEST_ARGS...]
#   --python  interpreter that creates the venv (default python3)
#   --torch   torch version to install first (default: whatever `torch>=2.4` resolves to)
#   --venv    where the venv goes (default: a temporary folder, removed unless --keep)
#   PYTEST_ARGS default to `-q -p no:cacheprovider` (add `-m gpu` on a GPU machine)
# Prints one summary line: python, torch, wheel, and the pytest result.
set -euo pipefail
cd "$(dirname "$0")/.."

wheel=""
python="python3"
torch_version=""
venv=""
keep=0
pytest_args=()
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheel) wheel="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --torch) torch_version="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check_install: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f "$wheel" ]] || { echo "check_install: --wheel '$wheel' is not a file" >&2; exit 2; }
[[ ${#pytest_args[@]} -gt 0 ]] || pytest_args=(-q -p no:cacheprovider)
if [[ -z "$venv" ]]; then
  venv="$(mktemp -d)/venv"
  [[ $keep == 1 ]] || trap 'rm -rf "$(dirname "$venv")"' EXIT
fi

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
if [[ -n "$torch_version" ]]; then
  "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" "$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")[test]"

# From outside the source tree: the import must find the installed package.
(cd /tmp && "$venv/bin/python" -c '
import sys, torch, flash_hopper
info = flash_hopper.build_info()
cuda, link = info.get("cuda"), info.get("link")
print(f"import: flash_hopper {flash_hopper.__version__} from {flash_hopper.__file__}")
print(f"        python {sys.version.split()[0]}, torch {torch.__version__}, library CUDA {cuda}, "
      f"link {link}")
assert "site-packages" in flash_hopper.__file__, "imported the source tree, not the wheel"
')
"$venv/bin/flash-hopper" info

set +e
"$venv/bin/python" -m pytest "${pytest_args[@]}" tests > "$venv/pytest.log" 2>&1
rc=$?
set -e
tail -n 3 "$venv/pytest.log"
py="$("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])')"
tv="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
echo "check_install: python $py, torch $tv, $(basename "$wheel"): pytest exit $rc," \
     "$(grep -E '[0-9]+ (passed|failed)' "$venv/pytest.log" | tail -n 1)"
exit $rc
