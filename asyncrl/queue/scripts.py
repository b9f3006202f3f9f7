"""Lua scripts the queue runs inside Redis, where check-then-write must be one atomic step.

    from asyncrl.queue.scripts import PUT_BOUNDED
    ids = client.register_script(PUT_BOUNDED)(keys=[stream, counters, produced],
                                               args=[maxlen, '0', 2, rec1, rec2, gid1, gid2])

Redis runs a script without interleaving other commands, so concurrent producers cannot
overshoot `maxlen` and concurrent generators cannot overshoot the admission budget.
"""

INCR = """
-- HINCRBY, but a field another client overwrote with text (or a number past 64 bits) is first
-- set back to 0: a bad counter costs its own count, never every caller's call (HINCRBY on
-- text is an error, which would end the trainer or stop every generator's admission).
local function incr(key, field, n)
  local cur = redis.call('HGET', key, field)
  if cur and not (string.match(cur, '^%-?%d+$') and #cur < 19) then redis.call('HSET', key, field, 0) end
  return redis.call('HINCRBY', key, field, n)
end
"""

PUT_BOUNDED = (
    INCR
    + """
-- KEYS[1] rollouts stream, KEYS[2] counters hash, KEYS[3] produced-ids set (the ledger),
-- KEYS[4] (optional) the producing generator's in-flight hash;
-- ARGV[1] maxlen, ARGV[2] '1' to record group ids in the ledger, ARGV[3] n, then n records,
-- then their n group ids, then (with KEYS[4]) their n prompt ids. Adds records while the
-- stream holds fewer than maxlen entries (undelivered + un-acked: acked entries are deleted);
-- returns the ids added, possibly fewer than given. Recording in the ledger and deleting
-- the prompts' in-flight notes in the same script keeps both exact across crashes: a
-- prompt is either still noted (a successor re-issues it) or its group is in the stream.
-- The note moves into the entry (field 'n'), so a consumer that drops the group as stale
-- can re-issue its prompt (asyncrl.queue.reissue).
local room = tonumber(ARGV[1]) - redis.call('XLEN', KEYS[1])
local n = tonumber(ARGV[3])
local ids = {}
for i = 1, n do
  if room <= 0 then break end
  local note = KEYS[4] and redis.call('HGET', KEYS[4], ARGV[3 + 2 * n + i])
  if note then
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[3 + i], 'n', note)
  else
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[3 + i])
  end
  if ARGV[2] == '1' then redis.call('SADD', KEYS[3], ARGV[3 + n + i]) end
  if KEYS[4] then redis.call('HDEL', KEYS[4], ARGV[3 + 2 * n + i]) end
  room = room - 1
end
if #ids > 0 then incr(KEYS[2], 'groups_produced', #ids) end
return ids
"""
)

TRY_ADMIT = (
    INCR
    + """
-- KEYS[1] state hash, KEYS[2] counters hash, KEYS[3] (optional) a generator's in-flight hash;
-- ARGV[1] n, and with KEYS[3]: ARGV[2] prompt id, ARGV[3] its note (n must be 1), and
-- optionally ARGV[4] the version of the weights the group will be sampled with.
-- Admitted iff groups_started + n <= floor((v + max_staleness + 1) / m) * groups_per_step,
-- with v = min(policy_version, ARGV[4]) and m = mini_batches_per_step (AReaL-style throttle,
-- docs/design/admission.md). A trainer step takes groups_per_step groups and raises the version by m,
-- and it trains a group only if v' + m - 1 - max_staleness <= its version (v' the step's
-- start), so a group sampled at v is usable up to trainer step floor((v + max_staleness +
-- 1) / m) - 1, counting from 0; every step before it takes groups_per_step. A generator whose
-- engine lags the announced version (an elastic one still loading it) is budgeted by what it
-- will really sample with, so it is not admitted to groups that would be dropped as stale.
-- Returns 1 admitted, 0 refused,
-- -1 when the trainer has not called configure_admission yet (refused too).
-- With a prompt, admission and its in-flight note are one step, and a prompt already noted
-- is admitted again without counting: a retry whose first reply was lost, not a new group.
local n = tonumber(ARGV[1])
if KEYS[3] and redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then return 1 end
local ms = tonumber(redis.call('HGET', KEYS[1], 'max_staleness') or '')
local gps = tonumber(redis.call('HGET', KEYS[1], 'groups_per_step') or '')
if ms == nil or gps == nil then return -1 end
local m = tonumber(redis.call('HGET', KEYS[1], 'mini_batches_per_step') or '1')
local v = tonumber(redis.call('HGET', KEYS[1], 'policy_version') or '0')
local started = incr(KEYS[2], 'groups_started', 0)  -- text another client wrote counts as 0
-- A state field some other client overwrote with text is no budget: refuse until the trainer
-- writes it again (RunState.reassert_owned), rather than fail every generator's call.
if m == nil or v == nil or m < 1 then return 0 end
if ARGV[4] then v = math.min(v, tonumber(ARGV[4])) end
if started + n <= math.floor((v + ms + 1) / m) * gps then
  incr(KEYS[2], 'groups_started', n)
  if KEYS[3] then redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) end
  return 1
end
return 0
"""
)

RELEASE_ADMISSION = (
    INCR
    + """
-- KEYS[1] counters hash; ARGV[1] n. groups_started -= n, never below 0; returns the new value.
local left = incr(KEYS[1], 'groups_started', -tonumber(ARGV[1]))
if left < 0 then
  redis.call('HSET', KEYS[1], 'groups_started', 0)
  left = 0
end
return left
"""
)

RELEASE_INFLIGHT = (
    INCR
    + """
-- KEYS[1] counters hash, KEYS[2] a generator's in-flight hash. Hands back the admission of
-- every prompt still noted there (groups_started -= count, never below 0) and deletes the
-- notes, in one step, so a retry after a lost reply releases nothing twice. Returns the count.
local n = redis.call('HLEN', KEYS[2])
if n > 0 then
  local left = incr(KEYS[1], 'groups_started', -n)
  if left < 0 then redis.call('HSET', KEYS[1], 'groups_started', 0) end
  redis.call('DEL', KEYS[2])
end
return n
"""
)

DROP_ADMITTED = (
    INCR
    + """
-- KEYS[1] counters hash, KEYS[2] a generator's in-flight hash; ARGV[1] prompt id, ARGV[2] the
-- counter to raise. A finished group the generator will not put (rollout.drop_uniform_groups):
-- its note is deleted, its admission handed back (groups_started -= 1, never below 0) and the
-- counter raised, in one step and only if the note was still there, so a retry after a lost
-- reply counts nothing twice and a prompt is never both dropped and re-issued by a successor.
-- Returns 1 if dropped now, 0 if the note was already gone.
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
local left = incr(KEYS[1], 'groups_started', -1)
if left < 0 then redis.call('HSET', KEYS[1], 'groups_started', 0) end
incr(KEYS[1], ARGV[2], 1)
return 1
"""
)

RETIRE_WEIGHTS = """
-- KEYS[1] state hash. A trainer starting on this run (fresh or resumed): forget the announced
-- weights and close admission until its prepare() configures it again, so no generator loads
-- a predecessor's weights or is admitted against its budget. Returns the highest version the
-- run ever announced (kept in versions_retired_upto, so a second restart still knows it).
local f = redis.call('HMGET', KEYS[1], 'weights_version', 'policy_version', 'versions_retired_upto')
local top = 0
for i = 1, 3 do
  -- only counts: text another client wrote ('1e999', 'inf') must not renumber the run's weights
  local v = f[i] and string.match(f[i], '^%d+$') and #f[i] < 16 and tonumber(f[i])
  if v and v > top then top = v end
end
redis.call('HSET', KEYS[1], 'versions_retired_upto', top)
redis.call('HDEL', KEYS[1], 'weights_location', 'weights_version', 'max_staleness', 'groups_per_step')
return top
"""

RESTART_ADMISSION = """
-- KEYS[1] counters hash, KEYS[2] rollouts stream, then ARGV[2] in-flight hashes whose prompts
-- will be re-issued (counted), then in-flight hashes nobody will re-issue (deleted); ARGV[1]
-- the base count. groups_started = base + entries in the stream (queued or pending) + the
-- counted notes, in one step: a put moves a note into the stream atomically, so nothing is
-- counted twice or missed. Returns the count.
local total = tonumber(ARGV[1]) + redis.call('XLEN', KEYS[2])
local counted = tonumber(ARGV[2])
for i = 3, 2 + counted do total = total + redis.call('HLEN', KEYS[i]) end
for i = 3 + counted, #KEYS do redis.call('DEL', KEYS[i]) end
if total < 0 then total = 0 end
redis.call('HSET', KEYS[1], 'groups_started', total)
return total
"""

NEXT_INCARNATION = """
-- KEYS[1] a generator's incarnation key. INCR, but a value that is not a count (some other
-- client wrote it) is first replaced by the server's clock in seconds, larger than any
-- count a run reaches by restarts, so no incarnation number, and with it no prompt id, is
-- used twice. Returns {the new count, 1 if the value was replaced else 0}.
local raw = redis.call('GET', KEYS[1])
local repaired = 0
if raw and not (string.match(raw, '^%d+$') and #raw < 16) then
  redis.call('SET', KEYS[1], redis.call('TIME')[1])
  repaired = 1
end
return {redis.call('INCR', KEYS[1]), repaired}
"""

INCR_MANY = (
    INCR
    + """
-- KEYS[1] counters hash; ARGV: field, n, field, n, ... Adds each n to its field by incr's rule
-- (a field overwritten with text restarts from 0). Returns the last field's new value.
local v = 0
for i = 1, #ARGV, 2 do v = incr(KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
return v
"""
)
