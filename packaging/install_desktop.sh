#!/usr/bin/env bash
# Add SpecPlay to the desktop's application menu for the current user (freedesktop.org layout).
#
#   packaging/install_desktop.sh                          # launches `specplay` from PATH (a pip install)
#   packaging/install_desktop.sh "$PWD/dist/SpecPlay/SpecPlay"   # launches the frozen app
#   packaging/install_desktop.sh --uninstall
#
# Installs packaging/specplay.desktop into $XDG_DATA_HOME/applications (default ~/.local/share)
# and the icons into $XDG_DATA_HOME/icons/hicolor/<size>/apps/specplay.png (+ scalable SVG).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA="${XDG_DATA_HOME:-$HOME/.local/share}"
SIZES="16 22 24 32 48 64 128 256 512"

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$DATA/applications/specplay.desktop" "$DATA/icons/hicolor/scalable/apps/specplay.svg"
    for n in $SIZES; do rm -f "$DATA/icons/hicolor/${n}x${n}/apps/specplay.png"; done
    echo "removed SpecPlay from $DATA"
    exit 0
fi

EXEC="${1:-specplay}"
case "$EXEC" in
    *[[:space:]]*) echo "the program path must not contain spaces: $EXEC" >&2; exit 2 ;;
esac

for n in $SIZES; do
    install -Dm644 "$ROOT/assets/icons/specplay-$n.png" "$DATA/icons/hicolor/${n}x${n}/apps/specplay.png"
done
install -Dm644 "$ROOT/assets/icons/specplay.svg" "$DATA/icons/hicolor/scalable/apps/specplay.svg"
mkdir -p "$DATA/applications"
sed -e "s|^Exec=.*|Exec=$EXEC|" -e "s|^TryExec=.*|TryExec=$EXEC|" \
    "$ROOT/packaging/specplay.desktop" > "$DATA/applications/specplay.desktop"

command -v update-desktop-database > /dev/null && update-desktop-database -q "$DATA/applications" || true
command -v gtk-update-icon-cache > /dev/null && gtk-update-icon-cache -q -t "$DATA/icons/hicolor" || true
echo "installed $DATA/applications/specplay.desktop (Exec=$EXEC) and the icons"
