#!/bin/sh
# Run by meson install: creates the traind group from sysusers.d right away, as a package's
# postinst would, so that the socket's group exists at the first start. Does nothing for a
# staged install (DESTDIR), without root, or without systemd-sysusers.
[ -z "${DESTDIR:-}" ] || exit 0
[ "$(id -u)" = 0 ] || exit 0
command -v systemd-sysusers >/dev/null 2>&1 || exit 0
systemd-sysusers "$1" || echo "traind: systemd-sysusers $1 failed; create the group traind" >&2
exit 0
