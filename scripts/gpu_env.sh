# Source on the GPU machine: installs the carried wheels (.whl) the image lacks into /tmp/site, and
# flextensor 0.5.0 (the peer, same import name as ours) into its own folder /tmp/peer.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v flextensor-) >/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer \
    .whl/flextensor-*.whl >/dev/null
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
set +e
