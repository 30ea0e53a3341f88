#!/usr/bin/env bash
# Build the one-folder Linux app: dist/SpecPlay/SpecPlay (+ dist/SpecPlay/_internal/).
#
#   packaging/build_app.sh            # reuse the build venv if it is there, else make it
#   packaging/build_app.sh --clean    # also start PyInstaller from scratch (build/pyinstaller/)
#
# The build venv (build/app-venv, or $SPECPLAY_BUILD_VENV) holds only the project's runtime
# dependencies from pyproject.toml, llama-cpp-python (the draft engine; it compiles llama.cpp,
# about 6 minutes on two cores), the CPU torch ($SPECPLAY_TORCH, default torch==2.13.0) and
# pyinstaller: nothing from a development venv (pytest, the 1.6 GB model packages) can leak in.
# SpecPlay itself is installed into it from this checkout as a normal (not editable) package,
# specplay.app / .core / .assets, which is what PyInstaller freezes. $PYTHON picks the interpreter
# for a new venv (default python3; 3.10 or newer).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECPLAY_BUILD_VENV:-$ROOT/build/app-venv}"
PYTHON="${PYTHON:-python3}"
TORCH="${SPECPLAY_TORCH:-torch==2.13.0}"
PYINSTALLER="${SPECPLAY_PYINSTALLER:-pyinstaller>=6.10}"
CLEAN=()
for arg in "$@"; do
    case "$arg" in
        --clean) CLEAN=(--clean); rm -rf "$ROOT/build/pyinstaller" ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

cd "$ROOT"
started=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating the build venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

echo "== installing the runtime dependencies and pyinstaller into $VENV"
mkdir -p "$ROOT/build"
"$PY" - > "$ROOT/build/app-requirements.txt" <<'PYEOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"]))
# llama.cpp, the draft engine the default speculative runs fastest on (the peers extra without its server).
print("\n".join(r.replace("[server]", "") for r in project["optional-dependencies"]["peers"]
                if r.startswith("llama-cpp-python")))
PYEOF
"$PY" -m pip install --quiet "$TORCH" -r "$ROOT/build/app-requirements.txt" "$PYINSTALLER"
echo "== installing SpecPlay from this checkout (not editable)"
"$PY" -m pip install --quiet --no-deps --force-reinstall "$ROOT"

echo "== building dist/SpecPlay with PyInstaller $("$PY" -m PyInstaller --version)"
rm -rf "$ROOT/dist/SpecPlay"
"$PY" -m PyInstaller --noconfirm "${CLEAN[@]}" --log-level WARN \
    --distpath "$ROOT/dist" --workpath "$ROOT/build/pyinstaller" \
    "$ROOT/packaging/specplay.spec"

APP="$ROOT/dist/SpecPlay/SpecPlay"
[ -x "$APP" ] || { echo "build failed: $APP is missing" >&2; exit 1; }
# A headless smoke check of the frozen executable: the command line lists the model catalog.
"$APP" models list > /dev/null || { echo "the frozen app does not start: $APP models list failed" >&2; exit 1; }

echo "== done in $(( $(date +%s) - started )) s: $APP ($(du -sh "$ROOT/dist/SpecPlay" | cut -f1))"
echo "   run it:  $APP        (the command line: $APP --help)"
