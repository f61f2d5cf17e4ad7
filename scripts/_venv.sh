# Sourced by demo.sh and test.sh: create .venv if needed and install the project into it.
# Usage: setup_venv EXTRAS   (e.g. "[torch]" or "[dev,torch,frameworks]")
# TORCH_SPEC picks the torch installed when the venv has none. The default pins 2.13.0, which on the project's
# CI machines is a local CPU build (no multi-GB CUDA download); `TORCH_SPEC=torch` takes whatever pip resolves.
# torch goes in first, on its own: the extras that need it (lightning, torchdata) then find it there and
# pull no other build of it.
setup_venv() {
    local py=${PYTHON:-python3}
    [ -x .venv/bin/python ] || "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # whether torch is installed, not imported (an import costs ~1.6 s of CPU on every run)
    .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null ||
        .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    .venv/bin/python -m pip install -q -e ".$1"
}
