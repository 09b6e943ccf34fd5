package redisstore

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// markFn marks a write script's call in the node's data, in the call
// (see [WriteSeqKey]): the count of writing calls goes up by one, and the
// highest group epoch a call was admitted under is kept, given gepoch.
const markFn = `
local function mark(gepoch)
  if gepoch then
    local w = tonumber(redis.call('GET', '` + WriteEpochKey + `') or '0')
    if tonumber(gepoch) > w then redis.call('SET', '` + WriteEpochKey + `', gepoch) end
  end
  redis.call('INCR', '` + WriteSeqKey + `')
end
`

// groupFenceFn refuses a call whose group epoch (that of the record its
// writer follows) is below the one a promotion stamped on the node
// (keel:group-epoch): a writer of an older record may be acknowledging
// through a deposed primary too. Every write script checks it before
// touching anything, with the same error (store.ErrGroupFenced).
const groupFenceFn = `
local function groupFence(gepoch)
  local g = tonumber(redis.call('GET', 'keel:group-epoch') or '0')
  if tonumber(gepoch) < g then return redis.error_reply('GROUPFENCED group epoch ' .. gepoch .. ' < ' .. g) end
  return false
end
`

// Every session script gets KEYS[1] = the session hash and ARGV[1], ARGV[2] =
// session epoch and group epoch, and checks both before touching anything;
// a call that passes is marked. A session's queue is the hash qe (msgID →
// entry JSON, whose "s" is its position) and the list ql of its positions
// in order ("<seq>:<msgID>", with holes: see trimQueue); message bodies
// live in buckets shared by every session (body, flushBodies).
const prelude = markFn + groupFenceFn + `
local function fence(skey, epoch, gepoch)
  local g = groupFence(gepoch); if g then return g end
  local cur = tonumber(redis.call('HGET', skey, 'epoch') or '0')
  if tonumber(epoch) < cur then return redis.error_reply('FENCED epoch ' .. epoch .. ' < ' .. cur) end
  mark(gepoch)
  return false
end
-- Message bodies live in buckets (see BodyKey): the body of message id is
-- field string.sub(id, -2) of hash "mb:" .. string.sub(id, 1, -3), or of
-- "mx:" .. string.sub(id, 1, -3) for a message with an MQTT expiry, so the
-- messages of one ingress edge numbered alike share a hash, a hundred to a
-- hash, and a call's bodies cost a command or two per bucket, not per
-- message. An "mx:" bucket expires with the latest of its bodies; an "mb:"
-- one lives as long as its bodies. A body's reference count is field
-- "#" .. field when above one (most messages go to one session), absent
-- at one. An entry says which bucket its message is in: an entry of a
-- message with an expiry has "x":1 (see expiring).
--
-- References are counted in a ledger while a script runs and written at
-- its end (flushBodies), one read and a write or two per bucket: so a
-- message released and taken again within one call never goes in
-- between, whatever the order of the call's parts.
local bodies, buckets = {}, {}
-- The messages of a call are mostly of one bucket: its name is made once.
local lastPrefix, lastX, lastBucket = nil, nil, nil
local function bucketOf(id, x)
  local p = string.sub(id, 1, -3)
  if p ~= lastPrefix or x ~= lastX then
    lastPrefix, lastX = p, x
    if x then lastBucket = 'mx:' .. p else lastBucket = 'mb:' .. p end
  end
  return lastBucket
end
local function body(id, x)
  local b, f = bucketOf(id, x), string.sub(id, -2)
  local t = bodies[b]
  if not t then
    t = {recs = {}, fields = {}, x = x}
    bodies[b] = t
    buckets[#buckets + 1] = b
  end
  local r = t.recs[f]
  if not r then
    r = {delta = 0, data = false, at = 0} -- sized once: a table grows by reallocating
    t.recs[f] = r
    t.fields[#t.fields + 1] = f
  end
  return r, b, f
end
-- expiring reports whether entry e (queued or in flight) is of a message
-- with an expiry. ("x":1 can only be a key and its value: a quote inside
-- a JSON string is escaped.)
local function expiring(e)
  return string.find(e, '"x":1', 1, true) ~= nil
end
-- stored reports whether message id's body is stored, given to this call
-- or before it (read once), and if so whether it expires.
local function stored(id)
  local f = string.sub(id, -2)
  for _, x in ipairs({false, true}) do
    local t = bodies[bucketOf(id, x)]
    local r = t and t.recs[f]
    if r and (r.data or r.exists) then return true, x end
  end
  for _, x in ipairs({false, true}) do
    local r, b = body(id, x)
    if r.exists == nil then r.exists = redis.call('HEXISTS', b, f) == 1 end
    if r.exists then return true, x end
  end
  return false, false
end
-- ref takes a reference to message id and returns whether it expires. A
-- body given (data, expiring at unix second at when at > 0: its MQTT
-- message expiry, past which no session delivers it) is stored unless one
-- is. Without data the message must be stored: ref returns false, having
-- taken nothing, when it is not. A message without an expiry lives as
-- long as a reference to it: a session may stay offline for as long as
-- its expiry interval allows.
local function ref(id, data, at)
  if data then
    local r = body(id, at > 0)
    if not r.data then r.data, r.at = data, at end
    r.delta = r.delta + 1
    return true, at > 0
  end
  local ok, x = stored(id)
  if not ok then return false, false end
  local r = body(id, x)
  r.delta = r.delta + 1
  return true, x
end
-- unref drops a reference to message id (x: whether it expires); the body
-- goes with its last.
local function unref(id, x)
  local r = body(id, x)
  r.delta = r.delta - 1
end
-- countQueued adds n to a tenant's count of queued entries (key tq:<tenant>),
-- which the tenant's queue bound is checked against; the key goes at 0
-- (and a count from before it was kept never goes below).
local function countQueued(k, n)
  if n == 0 then return end
  if redis.call('INCRBY', k, n) <= 0 then redis.call('DEL', k) end
end
-- Each redis.call costs about as much as the write it makes, so the
-- scripts read and write a call's entries in few commands. unpack is
-- bounded by Lua's C stack: chunks of 512 values.
local chunk = 512
-- each runs cmd on key with the values of list, a chunk at a time (list
-- holds pairs for HSET: chunks are even).
local function each(cmd, key, list)
  for i = 1, #list, chunk do
    redis.call(cmd, key, unpack(list, i, math.min(i + chunk - 1, #list)))
  end
end
-- hmget returns HMGET key list, false for a field not there.
local function hmget(key, list)
  if #list == 0 then return {} end
  if #list <= chunk then return redis.call('HMGET', key, unpack(list)) end
  local out = {}
  for i = 1, #list, chunk do
    local r = redis.call('HMGET', key, unpack(list, i, math.min(i + chunk - 1, #list)))
    for j = 1, #r do out[#out + 1] = r[j] end
  end
  return out
end
-- flushBodies writes the ledger: per bucket it reads the counts (and,
-- for bodies given, whether one is stored), then sets and deletes fields
-- in a command each. An "mx:" bucket that gains a body expires with the
-- latest of its bodies.
local function flushBodies()
  for _, b in ipairs(buckets) do
    local t = bodies[b]
    -- A body given whose existence is not known yet is asked for first
    -- (most are new: no count to read), every other one's count at once.
    local ask, fresh = {}, {}
    for _, f in ipairs(t.fields) do
      local r = t.recs[f]
      if r.data and r.exists == nil then fresh[#fresh + 1] = f else ask[#ask + 1] = '#' .. f end
    end
    local counts = {}
    if #fresh > 0 then
      local got = hmget(b, fresh)
      for j, f in ipairs(fresh) do
        local r = t.recs[f]
        r.exists = got[j] ~= false
        if r.exists then ask[#ask + 1] = '#' .. f end
      end
    end
    if #ask > 0 then
      local got = hmget(b, ask)
      for j, cf in ipairs(ask) do
        if got[j] then counts[string.sub(cf, 2)] = got[j] end
      end
    end
    local set, del = {}, {}
    local latest = 0
    for _, f in ipairs(t.fields) do
      local r = t.recs[f]
      local count = counts[f]
      local prior = 1
      if count then prior = tonumber(count) elseif r.exists == false then prior = 0 end
      local n = prior + r.delta
      if n <= 0 then
        if prior > 0 then
          del[#del + 1] = f
          if count then del[#del + 1] = '#' .. f end
        end
      else
        if prior == 0 then
          set[#set + 1] = f
          set[#set + 1] = r.data
          latest = math.max(latest, r.at)
        end
        if n > 1 then
          if n ~= prior then
            set[#set + 1] = '#' .. f
            set[#set + 1] = n
          end
        elseif count then
          del[#del + 1] = '#' .. f
        end
      end
    end
    local was = 0
    if t.x and latest > 0 then was = redis.call('EXPIRETIME', b) end
    each('HSET', b, set)
    each('HDEL', b, del)
    if t.x and latest > 0 and (was < 0 or latest > was) then redis.call('EXPIREAT', b, latest) end
  end
end
-- entrySeq is the queue position of an entry (its JSON starts with it).
local function entrySeq(e) return string.match(e, '^{"s":(%d+)') end
-- trimQueue keeps the queue's order list (KEYS[2], items "<seq>:<msgID>")
-- from growing with entries that left the queue (KEYS[3]) out of it: gone
-- at the front, it drops them there (taken is how many left in this call),
-- and it rewrites the list once such holes outnumber the entries; an
-- empty queue has no list.
local function trimQueue(taken)
  local live = redis.call('HLEN', KEYS[3])
  if live == 0 then
    redis.call('DEL', KEYS[2])
    return
  end
  local head = redis.call('LRANGE', KEYS[2], 0, taken + 63)
  local ids, seqs = {}, {}
  for i, item in ipairs(head) do seqs[i], ids[i] = string.match(item, '^(%d+):(.*)$') end
  local es = hmget(KEYS[3], ids)
  local k = 0
  for i = 1, #head do
    if es[i] and entrySeq(es[i]) == seqs[i] then break end
    k = i
  end
  if k > 0 then redis.call('LTRIM', KEYS[2], k, -1) end
  local n = redis.call('LLEN', KEYS[2])
  if n <= 2 * live + 64 then return end
  local items = redis.call('LRANGE', KEYS[2], 0, -1)
  ids, seqs = {}, {}
  for i, item in ipairs(items) do seqs[i], ids[i] = string.match(item, '^(%d+):(.*)$') end
  es = hmget(KEYS[3], ids)
  local keep = {}
  for i, item in ipairs(items) do
    if es[i] and entrySeq(es[i]) == seqs[i] then keep[#keep + 1] = item end
  end
  redis.call('DEL', KEYS[2])
  each('RPUSH', KEYS[2], keep)
end
`

// activate: KEYS s; ARGV epoch gepoch. A newer epoch only.
const scriptActivate = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
return 1`

// putSession: KEYS s; ARGV epoch gepoch record.
const scriptPutSession = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
redis.call('HSET', KEYS[1], 'rec', ARGV[3])
return 1`

// deleteSession: KEYS s sub ql qe inf in took tq; ARGV epoch gepoch.
// Keeps the epoch.
const scriptDeleteSession = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local qe = redis.call('HGETALL', KEYS[4])
countQueued(KEYS[8], -#qe / 2)
for i = 1, #qe, 2 do unref(qe[i], expiring(qe[i + 1])) end
for _, e in ipairs(redis.call('HVALS', KEYS[5])) do unref(cjson.decode(e).m, expiring(e)) end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('HDEL', KEYS[1], 'rec', 'seq')
flushBodies()
return 1`

// putSub: KEYS s sub; ARGV epoch gepoch filter json.
const scriptPutSub = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1`

// delSub: KEYS s sub; ARGV epoch gepoch filter.
const scriptDelSub = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
return redis.call('HDEL', KEYS[2], ARGV[3])`

// send moves entries into the in-flight set KEYS[4]: the (msgID, packetID,
// entryJSON, qos) quads of ARGV from index at. A queued entry (in KEYS[3])
// moves with its reference, and so does one in direct (appended by this
// call and sent at once: it holds a reference but no queue entry); an
// entry that was never queued must refer to a stored message. A msgID
// twice takes the queue's (or direct) reference once: the other copy is a
// new reference. Returns an error text, having written nothing, when a
// message is stored nowhere. The script defines tq, its tenant's count
// key, before it.
const sendFn = `
local function send(at, direct, directX)
  local n = (#ARGV - at + 1) / 4
  local ids, look, lookAt = {}, {}, {}
  for j = 1, n do
    ids[j] = ARGV[at + 4 * (j - 1)]
    if not direct[ids[j]] then look[#look + 1] = ids[j]; lookAt[j] = #look end
  end
  local found = hmget(KEYS[3], look)
  local queued = {}
  for j = 1, n do queued[j] = lookAt[j] and found[lookAt[j]] end
  -- The first copy of a msgID that is queued or in direct takes its
  -- reference along; every other copy sent at QoS 1 or 2 takes one of its
  -- own, from a message that must be stored: refuse, before writing
  -- anything, a delivery of a message stored nowhere.
  local taken, held, xs = {}, {}, {}
  for j = 1, n do
    local id = ids[j]
    if direct[id] then xs[j] = directX[id] elseif queued[j] then xs[j] = expiring(queued[j]) end
    if not taken[id] then
      taken[id] = true
      held[j] = direct[id] or queued[j] ~= false
    end
    if not held[j] and ARGV[at + 4 * (j - 1) + 3] ~= '0' then
      local ok, x = stored(id)
      if not ok then return 'NOMSG message ' .. id .. ' is not stored' end
      xs[j] = x
    end
  end
  local dequeue, drops, pks, sent, inf = {}, {}, {}, {}, {}
  for j = 1, n do
    local b = at + 4 * (j - 1)
    local id, pk, entry, qos = ids[j], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
    if held[j] and not direct[id] then dequeue[#dequeue + 1] = id end
    if qos == '0' then
      if held[j] then drops[#drops + 1] = j end
    else
      if not held[j] then ref(id, false, 0) end
      pks[#pks + 1] = pk
      sent[#sent + 1] = j
      inf[#inf + 1] = pk
      if xs[j] then entry = '{"x":1,' .. string.sub(entry, 2) end
      inf[#inf + 1] = entry
    end
  end
  each('HDEL', KEYS[3], dequeue)
  countQueued(tq, -#dequeue)
  -- An entry replaced at its packet ID lets its reference go; so does one
  -- this call wrote and then replaced.
  local old = hmget(KEYS[4], pks)
  local wrote = {}
  for k = 1, #pks do
    local w = wrote[pks[k]]
    if w then
      unref(ids[w], xs[w])
    elseif old[k] then
      unref(cjson.decode(old[k]).m, expiring(old[k]))
    end
    wrote[pks[k]] = sent[k]
  end
  each('HSET', KEYS[4], inf)
  for _, j in ipairs(drops) do unref(ids[j], xs[j]) end
  if #dequeue > 0 then trimQueue(#dequeue) end
  return false
end
`

// tookMark precedes the entry JSON of an append's entry marked TookQoS2.
const tookMark = '!'

// append: KEYS s ql qe inf took tq; ARGV epoch gepoch maxLen dropOldest
// tenantMax, then segments, each a count n and n (msgID, entryJSON, body,
// expireAt) quads (expireAt: unix seconds when the message's body may go,
// 0 never): the appends of one session that a commit merged into one call;
// then, optionally, "S" and the quads of a send of the session that came
// right after them (see merge). Returns one {added, dups, dropped, refused}
// per segment, and after them 1 or the send's error text when a send came.
//
// An entry comes as its JSON after the '{' (the store splices its position
// and bucket in front). An entry marked TookQoS2 comes as tookMark then that: its msgID joins
// the list KEYS[5] (the newest last, the last tookLen kept) when the entry
// is queued or sent at once, or found queued already, never when the queue
// limit refuses it. An unmarked entry costs a byte comparison and no
// command; the marked ones of a call cost one RPUSH together, an LTRIM
// once the list outgrows tookLen, and one LRANGE when one was queued
// already, so that a retry of an append does not list its msgIDs twice. A
// fresh entry is listed without looking: its msgID could be listed only if
// an edge let a resend through, and a second copy in the list is harmless.
//
// An entry the send delivers at once never enters the queue: it takes its
// message's reference straight into the in-flight set, and neither counts
// against the queue's bound nor costs the queue's writes and their removal
// (nor a queue position).
//
// The entry JSON comes without "s" and never empty ("m":...}); its queue
// position is spliced in as text rather than by decoding and encoding it.
// The session's sequence and queue length are read once and written once,
// which entries are queued already is one HMGET, and the new entries go in
// with one HSET and one RPUSH (written before a drop of the oldest, which
// must see them): per record, Lua's calls cost as much as the record's own
// writes.
var scriptAppend = prelude + "local tq = KEYS[6]\n" + sendFn + `
local tookLen, tookMark = ` + strconv.Itoa(store.TookQoS2Len) + `, ` + strconv.Itoa(tookMark) + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local maxLen, dropOldest, tenantMax = tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local seq0 = seq
local card = 0
if maxLen > 0 or tenantMax > 0 then card = redis.call('HLEN', KEYS[3]) end
-- tcount: the tenant's queued entries, kept whether or not it has a bound
-- (so that one set later finds them counted); tdelta: this call's change.
local tcount, tdelta = 0, 0
if tenantMax > 0 then tcount = tonumber(redis.call('GET', tq) or '0') end
local ids = {}
local i = 6
while i <= #ARGV and ARGV[i] ~= 'S' do
  local n = tonumber(ARGV[i])
  for k = 0, n - 1 do ids[#ids + 1] = ARGV[i + 1 + 4 * k] end
  i = i + 1 + 4 * n
end
local sendAt = nil
local sending = {}
if i <= #ARGV then
  sendAt = i + 1
  for j = sendAt, #ARGV, 4 do sending[ARGV[j]] = true end
end
local queued = hmget(KEYS[3], ids)
local added_now, popped, direct, directX, directs = {}, {}, {}, {}, {}
local hset, rpush = {}, {}
-- queue writes the entry of message id (tail: its JSON after the '{';
-- x: whether the message expires) at the next queue position.
local function queue(id, tail, x)
  seq = seq + 1
  local s = string.format('%d', seq)
  hset[#hset + 1] = id
  if x then
    hset[#hset + 1] = '{"s":' .. s .. ',"x":1,' .. tail
  else
    hset[#hset + 1] = '{"s":' .. s .. ',' .. tail
  end
  rpush[#rpush + 1] = s .. ':' .. id
end
local function flush()
  each('HSET', KEYS[3], hset)
  each('RPUSH', KEYS[2], rpush)
  hset, rpush = {}, {}
end
-- popOldest takes the oldest entry out of the queue and returns its
-- msgID and whether its message expires, skipping the list's items for
-- entries that left it.
local function popOldest()
  while true do
    local item = redis.call('LPOP', KEYS[2])
    if not item then return nil end
    local s, id = string.match(item, '^(%d+):(.*)$')
    local e = redis.call('HGET', KEYS[3], id)
    if e and entrySeq(e) == s then
      redis.call('HDEL', KEYS[3], id)
      return id, expiring(e)
    end
  end
end
local took, tookNow, listed = {}, {}, nil
local function remember(id, dup)
  if tookNow[id] then return end
  tookNow[id] = true
  if dup then
    if not listed then
      listed = {}
      for _, x in ipairs(redis.call('LRANGE', KEYS[5], 0, -1)) do listed[x] = true end
    end
    if listed[id] then return end
  end
  took[#took + 1] = id
end
local results = {}
local r = 0
i = 6
while i <= #ARGV and ARGV[i] ~= 'S' do
  local n = tonumber(ARGV[i])
  i = i + 1
  local added, dups, dropped, refused = 0, 0, 0, 0
  for _ = 1, n do
    local id, entry, msg, at = ARGV[i], ARGV[i+1], ARGV[i+2], tonumber(ARGV[i+3])
    i = i + 4
    r = r + 1
    -- The entry comes as its JSON after the '{' (after the mark).
    local marked = string.byte(entry) == tookMark
    if marked then entry = string.sub(entry, 2) end
    if added_now[id] or (queued[r] and not popped[id]) then
      dups = dups + 1
      if marked then remember(id, true) end
    elseif sending[id] then
      ref(id, msg, at)
      added_now[id], direct[id], directX[id] = true, true, at > 0
      directs[#directs + 1] = {id, entry, at > 0}
      added = added + 1
      if marked then remember(id, false) end
    else
      local ok, made = true, false
      if maxLen > 0 and card >= maxLen then
        if dropOldest then
          flush()
          local old, oldX = popOldest()
          if old then
            unref(old, oldX)
            added_now[old], popped[old] = nil, true
            dropped = dropped + 1
            card = card - 1
            tdelta = tdelta - 1
            made = true
          end
        else
          refused = refused + 1
          ok = false
        end
      end
      -- The tenant's bound refuses the newest: which of its sessions
      -- should lose an entry instead is not this call's to choose. An
      -- entry the session's own drop made room for leaves the count as
      -- it was, and is not refused after the drop.
      if ok and not made and tenantMax > 0 and tcount + tdelta >= tenantMax then
        refused = refused + 1
        ok = false
      end
      if ok then
        queue(id, entry, at > 0)
        ref(id, msg, at)
        added_now[id] = true
        added = added + 1
        card = card + 1
        tdelta = tdelta + 1
        if marked then remember(id, false) end
      end
    end
  end
  table.insert(results, {added, dups, dropped, refused})
end
flush()
local listLen = 0
for j = 1, #took, chunk do listLen = redis.call('RPUSH', KEYS[5], unpack(took, j, math.min(j + chunk - 1, #took))) end
if listLen > tookLen then redis.call('LTRIM', KEYS[5], -tookLen, -1) end
if sendAt then
  local e = send(sendAt, direct, directX)
  if e then
    -- The send wrote nothing: the messages this call stored for it go
    -- into the queue, as the append's answer says they were taken, and
    -- the edge's next send finds them there.
    for _, d in ipairs(directs) do
      queue(d[1], d[2], d[3])
      tdelta = tdelta + 1
    end
    flush()
  end
  table.insert(results, e or 1)
end
countQueued(tq, tdelta)
if seq ~= seq0 then redis.call('HSET', KEYS[1], 'seq', string.format('%d', seq)) end
flushBodies()
return results`

// send: KEYS s ql qe inf tq; ARGV epoch gepoch, then (msgID, packetID,
// entryJSON, qos) quads.
const scriptSend = prelude + "local tq = KEYS[5]\n" + sendFn + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local e = send(3, {}, {})
if e then return redis.error_reply(e) end
flushBodies()
return 1`

// pubrel: KEYS s inf; ARGV epoch gepoch packetID.
const scriptPubrel = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local e = redis.call('HGET', KEYS[2], ARGV[3])
if not e then return 0 end
-- Spliced in, not decoded and encoded: the entry keeps its fields as
-- written.
if not string.find(e, '"rel":true', 1, true) then
  redis.call('HSET', KEYS[2], ARGV[3], string.sub(e, 1, -2) .. ',"rel":true}')
end
return 1`

// complete: KEYS s inf; ARGV epoch gepoch packetIDs... Returns how many
// were in flight.
const scriptComplete = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local pks = {}
for i = 3, #ARGV do pks[#pks + 1] = ARGV[i] end
local es = hmget(KEYS[2], pks)
local done, gone = {}, {}
for j = 1, #pks do
  if es[j] and not gone[pks[j]] then
    gone[pks[j]] = true
    done[#done + 1] = pks[j]
    unref(cjson.decode(es[j]).m, expiring(es[j]))
  end
end
each('HDEL', KEYS[2], done)
flushBodies()
return #done`

// dequeue: KEYS s ql qe tq; ARGV epoch gepoch msgIDs... Returns how many
// were queued.
const scriptDequeue = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
local es = hmget(KEYS[3], ids)
local gone, seen = {}, {}
for j = 1, #ids do
  if es[j] and not seen[ids[j]] then
    seen[ids[j]] = true
    gone[#gone + 1] = ids[j]
    unref(ids[j], expiring(es[j]))
  end
end
each('HDEL', KEYS[3], gone)
countQueued(KEYS[4], -#gone)
if #gone > 0 then trimQueue(#gone) end
flushBodies()
return #gone`

// putIncoming / delIncoming: KEYS s in; ARGV epoch gepoch packetID [msgID].
const scriptPutIncoming = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1`

const scriptDelIncoming = prelude + `
local f = fence(KEYS[1], ARGV[1], ARGV[2]); if f then return f end
return redis.call('HDEL', KEYS[2], ARGV[3])`

// load: KEYS s sub ql qe inf in took. Returns {epoch, rec, subs, queue
// order (ql's items), queue entries (qe as field-value pairs), inflight,
// incoming, bodies, took}, all read at one instant; the caller puts the
// queue in order.
const scriptLoad = `
local fmt = redis.call('GET', '` + FormatKey + `')
if fmt ~= '` + Format + `' and (fmt or redis.call('EXISTS', '` + WriteSeqKey + `') == 1) then
  return redis.error_reply('FORMAT group holds data of format ' .. (fmt or '1'))
end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or '0'
local rec = redis.call('HGET', KEYS[1], 'rec') or ''
local subs = redis.call('HVALS', KEYS[2])
local order = redis.call('LRANGE', KEYS[3], 0, -1)
local qe = redis.call('HGETALL', KEYS[4])
local inf = redis.call('HVALS', KEYS[5])
local inc = redis.call('HGETALL', KEYS[6])
local buckets, want = {}, {}
local function add(id, e)
  local b = 'mb:'
  if string.find(e, '"x":1', 1, true) then b = 'mx:' end
  b = b .. string.sub(id, 1, -3)
  local f = string.sub(id, -2)
  local t = want[b]
  if not t then t = {seen = {}}; want[b] = t; buckets[#buckets + 1] = b end
  if not t.seen[f] then t.seen[f] = true; t[#t + 1] = f end
end
for i = 1, #qe, 2 do add(qe[i], qe[i + 1]) end
for _, e in ipairs(inf) do add(cjson.decode(e).m, e) end
local msgs = {}
for _, b in ipairs(buckets) do
  local fs = want[b]
  for i = 1, #fs, 512 do
    for _, d in ipairs(redis.call('HMGET', b, unpack(fs, i, math.min(i + 511, #fs)))) do
      if d then msgs[#msgs + 1] = d end
    end
  end
end
return {epoch, rec, subs, order, qe, inf, inc, msgs, redis.call('LRANGE', KEYS[7], 0, -1)}`

// putRetained: KEYS r (hash topic -> JSON); ARGV tenant topic json created
// empty gepoch (the writer's group epoch, fenced as a session script's, and
// for the call's mark). The index is a tree of sets "ri:<tenant>:<n>:<prefix>" holding the
// child levels of a prefix of n levels (n keeps "" at the root apart from an
// empty first level). A message is replaced only by a newer one; an empty
// payload deletes it and prunes the index.
const scriptPutRetained = markFn + groupFenceFn + `
local fenced = groupFence(ARGV[6]); if fenced then return fenced end
mark(ARGV[6])
local tenant, topic, json, created, empty = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local function node(prefix, n) return 'ri:' .. tenant .. ':' .. n .. ':' .. prefix end
-- older compares creation times (unix ns) as decimal text: as Lua numbers
-- (doubles) times 256 ns apart compare equal.
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local old = redis.call('HGET', KEYS[1], topic)
if old then
  local c = string.match(old, ',"c":(%d+)') or string.format('%d', cjson.decode(old).c)
  if older(created, c) then return 0 end
end
local levels = {}
for l in string.gmatch(topic .. '/', '([^/]*)/') do table.insert(levels, l) end
if empty then
  if not old then return 0 end
  redis.call('HDEL', KEYS[1], topic)
  for i = #levels, 1, -1 do
    local prefix = table.concat(levels, '/', 1, i)
    if redis.call('SCARD', node(prefix, i)) > 0 or (i < #levels and redis.call('HEXISTS', KEYS[1], prefix) == 1) then break end
    redis.call('SREM', node(table.concat(levels, '/', 1, i - 1), i - 1), levels[i])
  end
  return 1
end
for i, l in ipairs(levels) do
  redis.call('SADD', node(table.concat(levels, '/', 1, i - 1), i - 1), l)
end
redis.call('HSET', KEYS[1], topic, json)
return 1`

// lookupRetained: KEYS r; ARGV tenant filter limit. Walks the index; leading
// wildcards do not match $-topics ([MQTT-4.7.2-1]).
const scriptLookupRetained = `
local tenant, filter, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function node(prefix, n) return 'ri:' .. tenant .. ':' .. n .. ':' .. prefix end
local levels = {}
for l in string.gmatch(filter .. '/', '([^/]*)/') do table.insert(levels, l) end
local out, seen = {}, {}
local function emit(topic)
  if #out >= limit or seen[topic] then return end
  seen[topic] = true
  local v = redis.call('HGET', KEYS[1], topic)
  if v then table.insert(out, v) end
end
local function join(prefix, l, n)
  if n == 0 then return l end
  return prefix .. '/' .. l
end
-- each calls f with the members of set key, a few hundred at a time, until
-- out is full: a wildcard level with many children costs what the answer
-- needs, not the whole set. (SSCAN may return a member twice if the set is
-- resized between pages, which no write in this script can do; emit
-- answers a topic once all the same.)
local function each(key, f)
  local cursor = '0'
  repeat
    local r = redis.call('SSCAN', key, cursor, 'COUNT', 256)
    cursor = r[1]
    for _, c in ipairs(r[2]) do
      if #out >= limit then return end
      f(c)
    end
  until cursor == '0' or #out >= limit
end
-- all emits every topic below prefix (n levels).
local function all(prefix, n)
  each(node(prefix, n), function(c)
    if not (n == 0 and string.sub(c, 1, 1) == '$') then
      local p = join(prefix, c, n)
      emit(p)
      all(p, n + 1)
    end
  end)
end
-- walk matches levels[n+1..] below prefix (n levels).
local function walk(prefix, n)
  if #out >= limit then return end
  local l = levels[n + 1]
  if l == '#' then
    if n > 0 then emit(prefix) end -- "a/#" matches "a" too
    all(prefix, n)
    return
  end
  local function step(c)
    local p = join(prefix, c, n)
    if n + 1 == #levels then emit(p) else walk(p, n + 1) end
  end
  if l ~= '+' then
    step(l)
    return
  end
  each(node(prefix, n), function(c)
    if not (n == 0 and string.sub(c, 1, 1) == '$') then step(c) end
  end)
end
walk('', 0)
return out`

// Format is the layout of the data the scripts read and write, kept in
// FormatKey. Format 1 (message bodies under "m:<msgID>", queues as sorted
// sets) came before the first release and is not read: a group holding
// its data is refused (see scriptFormat).
const (
	Format    = "2"
	FormatKey = "keel:format"
)

// format: no KEYS or ARGV. Returns the group's format, stamping a fresh
// group (one no write script ever wrote to: every one counts its calls in
// WriteSeqKey) with Format. Data from before the stamp existed counts as
// format 1.
const scriptFormat = `
local f = redis.call('GET', '` + FormatKey + `')
if f then return f end
if redis.call('EXISTS', '` + WriteSeqKey + `') == 1 then return '1' end
redis.call('SET', '` + FormatKey + `', '` + Format + `')
return '` + Format + `'`

var allScripts = []string{scriptActivate, scriptPutSession, scriptDeleteSession, scriptPutSub, scriptDelSub, scriptAppend,
	scriptSend, scriptPubrel, scriptComplete, scriptDequeue, scriptPutIncoming, scriptDelIncoming, scriptPutRetained}

var shas = func() map[string]string {
	m := make(map[string]string, len(allScripts))
	for _, s := range allScripts {
		sum := sha1.Sum([]byte(s))
		m[s] = hex.EncodeToString(sum[:])
	}
	return m
}()

func shaOf(script string) string { return shas[script] }

// loadScripts loads every write script on the connection's server, so
// writes can be sent as EVALSHA (the script text is not sent each time).
func loadScripts(ctx context.Context, conn *redis.Conn) error {
	_, err := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, s := range allScripts {
			p.ScriptLoad(ctx, s)
		}
		return nil
	})
	return err
}

// ErrFormat reports a Redis group whose data this store cannot read.
var ErrFormat = errors.New("redis group holds data of another store format")

// checkFormat makes sure the connection's server holds data of [Format]
// (stamping a fresh one).
func checkFormat(ctx context.Context, conn *redis.Conn) error {
	f, err := conn.Eval(ctx, scriptFormat, nil).Text()
	if err != nil {
		return fmt.Errorf("%w: reading the store format: %v", ErrUnavailable, err)
	}
	if f != Format {
		return fmt.Errorf("%w: %w: format %s (%s), this keel-persistence reads format %s", ErrUnavailable, ErrFormat, f, FormatKey, Format)
	}
	return nil
}
