# Sourced by toy.sh and test.sh: make .venv hold what a requirements file lists, then activate it.
# Idempotent: the install runs again only when a requirements file changed since the last one.
req="$1"
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
stamp=".venv/.installed-$(cat requirements*.txt | sha1sum | cut -c1-12)-$req"
if [ ! -f "$stamp" ]; then
  pip install -q --disable-pip-version-check --no-compile -r "$req"
  # vLLM's CPU build brings vision/audio packages built for another torch; they break `import vllm`
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The bytecode, compiled on every core rather than by pip one file at a time (52 s here instead of 85), and
  # not for the packages' own test suites (one file in eight), which nothing here imports; a few files of
  # theirs fail to compile at all, in pip too
  python -m compileall -q -j 0 -x '/tests?/' \
    "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
  touch "$stamp"
fi
