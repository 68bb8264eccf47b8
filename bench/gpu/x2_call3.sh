#!/usr/bin/env bash
# H200 x2, call 3 of 3: wait for the soak on GPU 1 to finish and collect its report.
set -u
for _ in $(seq ${SOAK_WAIT:-100}); do [ -f /root/soak/soak.md ] && break; sleep 5; done
cp /root/soak/soak.json /root/soak/soak.md "$OUT/" 2>/dev/null
grep -v "INFO:httpx" /root/soak.log | tail -300 > "$OUT/soak.log"
cat /root/soak/soak.md 2>/dev/null; tail -3 /root/soak.log
