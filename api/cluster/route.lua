-- vlmserve routing for HAProxy: which replica a chat request should reach, decided from what the
-- balancer can see (the headers and the first tune.bufsize bytes of the body; see haproxy.cfg.in).
--
--   1. an `x-session-id` header          -> its home replica  (route "session")
--   2. the first image URL of the body   -> its home replica  (route "image")
--   3. the request's `user` field        -> its home replica  (route "user")
--   4. none of these (text, anonymous)   -> the least-loaded replica (route "least-loaded")
--
-- A key's home is found by rendezvous hashing: every eligible replica scores xxh3(key's hash, replica's
-- name) and the key goes to the highest score whose load is under the bound. Every balancer with the same
-- replica names agrees, and when a replica leaves only its own keys move. The bound (in-flight requests,
-- HAProxy's own per-server counters) is max(min_load, ceil(factor/100 x mean load)): one hot image cannot
-- swamp a replica, but below min_load requests in flight no key leaves its home, because a replica batches
-- that many at no cost and every spill prefills a page a second time on another replica. The choice is
-- named in txn.vlmserve_pick for `use-server`; text and image requests are counted in one place.
--
-- An image is identified by the first `key_chars` characters of its URL's payload (the base64 text
-- after the comma of a data: URL, or the http(s) URL itself). A payload shorter than that counts whole
-- once its closing quote is in view. If the balancer cannot see `key_chars` characters (the image
-- starts too late in a large body), the rule does not apply: a partial slice would depend on what came
-- before the image and send the same image to different replicas.

local rr = 0 -- tie-break among equally loaded replicas (the Lua state is shared by HAProxy's threads)

local function first_image_value(body)
  local pos = 1
  while true do
    local _, e = body:find('"image_url"%s*:%s*', pos)
    if not e then
      return nil
    end
    local c = body:sub(e + 1, e + 1)
    if c == '"' then -- the bare-string form: "image_url": "https://..."
      return e + 2
    end
    if c == "{" then -- {"url": ..., "detail": ...} in either order
      local _, url_end = body:find('"url"%s*:%s*"', e + 1)
      local close = body:find("}", e + 1, true)
      if url_end and (close == nil or url_end < close) then
        return url_end + 1
      end
    end
    pos = e + 1
  end
end

local function image_identity(body, key_chars)
  local start = first_image_value(body)
  if not start then
    return nil
  end
  -- NOTE: base64 and URLs hold no quote; a JSON encoder may escape '/' as '\/', which is undone so
  -- that two clients sending the same bytes agree.
  local stop = body:find('"', start, true)
  local raw = body:sub(start, (stop or (#body + 1)) - 1)
  if raw:sub(1, 5) == "data:" then
    local comma = raw:find(",", 1, true)
    if not comma then
      return nil
    end
    raw = raw:sub(comma + 1)
  end
  raw = raw:gsub("\\/", "/")
  if #raw >= key_chars then
    return raw:sub(1, key_chars)
  end
  if stop then
    return raw
  end
  return nil
end

local function user_field(body)
  -- NOTE: a JSON key, not text inside a message: a quote inside a string is escaped, so `"user":`
  -- preceded by `{` or `,` is a key. Only the visible part of the body is searched.
  local _, _, user = body:find('[{,]%s*"user"%s*:%s*"([^"\\]*)"')
  if user and user ~= "" then
    return user
  end
  return nil
end

local function eligible(status)
  -- "UP", "UP 1/2" (failing checks, not yet down) and "no check"; not DOWN, MAINT, DRAIN or NOLB.
  return status:sub(1, 2) == "UP" or status == "no check"
end

local function loads(backend)
  -- name -> requests in flight (connected and queued), for the replicas that may take requests
  local out, n = {}, 0
  for name, server in pairs(core.backends[backend].servers) do
    local st = server:get_stats()
    if eligible(st.status) then
      out[name] = (tonumber(st.scur) or 0) + (tonumber(st.qcur) or 0)
      n = n + 1
    end
  end
  return out, n
end

local function least_loaded(load)
  local best, names = math.huge, {}
  for name, l in pairs(load) do
    if l < best then
      best, names = l, { name }
    elseif l == best then
      names[#names + 1] = name
    end
  end
  if #names == 0 then
    return nil
  end
  table.sort(names)
  rr = rr + 1
  return names[rr % #names + 1]
end

local function home(txn, key_hash, load, n, factor, min_load)
  local total = 1 -- this request
  for _, l in pairs(load) do
    total = total + l
  end
  local bound = math.max(min_load, math.ceil(factor * total / (100 * n)))
  local ranked = {}
  for name, _ in pairs(load) do
    ranked[#ranked + 1] = { txn.c:xxh3(key_hash .. "@" .. name), name }
  end
  table.sort(ranked, function(a, b)
    return a[1] > b[1] or (a[1] == b[1] and a[2] < b[2])
  end)
  -- NOTE: with factor >= 100 some replica is always under the bound (not all can be above the mean).
  for _, r in ipairs(ranked) do
    if load[r[2]] < bound then
      return r[2]
    end
  end
  return ranked[1] and ranked[1][2]
end

local function route_key(txn, key_chars)
  local session = txn.f:req_hdr("x-session-id")
  if session and session ~= "" then
    return "session", "session:" .. session
  end
  local body = txn.f:req_body() or ""
  local image = image_identity(body, key_chars)
  if image then
    return "image", image
  end
  local user = user_field(body)
  if user then
    return "user", "user:" .. user
  end
  return "least-loaded", nil
end

local function route(txn, backend, key_chars, factor, min_load)
  local kind, key = route_key(txn, tonumber(key_chars))
  txn:set_var("txn.vlmserve_route", kind)
  local load, n = loads(backend)
  local pick
  if key then
    local key_hash = tostring(txn.c:xxh3(key))
    txn:set_var("txn.vlmserve_key", key_hash)
    pick = home(txn, key_hash, load, n, tonumber(factor), tonumber(min_load))
  else
    pick = least_loaded(load)
  end
  if pick then
    txn:set_var("txn.vlmserve_pick", pick)
  end
end

core.register_action("vlmserve_route", { "http-req" }, route, 4)
