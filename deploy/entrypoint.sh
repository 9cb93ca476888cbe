#!/bin/sh
# The image's entry point: `IMAGE --help`, `IMAGE registry ...` and `IMAGE lorafarm registry ...`
# all run lorafarm; a program on PATH (`IMAGE sh -c ...`, `IMAGE python ...`) runs as given.
set -e
if [ "$#" -eq 0 ]; then
    exec lorafarm --help
fi
case "$1" in
    -*) exec lorafarm "$@" ;;
esac
if command -v -- "$1" >/dev/null 2>&1; then
    exec "$@"
fi
exec lorafarm "$@"
