-- wrk script for bench/compare.py: every request POSTs the same pre-encoded
-- /v1/run body, read from a file once per thread, and the summary is one
-- JSON line that compare.py parses.
--
--   wrk -c N -d 3s -s bench/run.lua URL -- BODY_FILE CONTENT_TYPE PROGRAM_DIGEST [PATH]

function init(args)
   local file = assert(io.open(args[1], "rb"))
   wrk.body = file:read("*a")
   file:close()
   wrk.method = "POST"
   wrk.path = args[4] or "/v1/run"
   wrk.headers["Content-Type"] = args[2]
   wrk.headers["X-KCoral-Program"] = args[3]
end

function done(summary, latency, requests)
   local errors = summary.errors
   io.write(string.format(
      'kcoral-wrk {"requests": %d, "microseconds": %d, "p50_us": %d, "p99_us": %d, ' ..
      '"max_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}\n',
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
      latency.max, errors.connect, errors.read, errors.write, errors.status, errors.timeout))
end
