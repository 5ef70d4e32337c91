-- vlmserve routing for HAProxy: which replica a chat request should reach, decided from what the
-- balancer can see (the headers and the first tune.bufsize bytes of the body; see haproxy.cfg.in).
--
--   1. an `x-session-id` header          -> consistent hash of it  (route "session")
--   2. the first image URL of the body   -> consistent hash of it  (route "image")
--   3. the request's `user` field        -> consistent hash of it  (route "user")
--   4. none of these (text, anonymous)   -> the least-loaded replica (route "least-loaded")
--
-- Rules 1-3 set txn.vlmserve_key, which the backend hashes (`balance hash`, `hash-type consistent`,
-- `hash-balance-factor` for bounded load: HAProxy's own algorithm). Rule 4 names a server in
-- txn.vlmserve_pick for `use-server`, from HAProxy's own per-server counters, so text and image
-- requests are counted in one place.
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

local function least_loaded(backend)
  local best, names = math.huge, {}
  for name, server in pairs(core.backends[backend].servers) do
    local st = server:get_stats()
    if eligible(st.status) then
      local load = (tonumber(st.scur) or 0) + (tonumber(st.qcur) or 0)
      if load < best then
        best, names = load, { name }
      elseif load == best then
        names[#names + 1] = name
      end
    end
  end
  if #names == 0 then
    return nil
  end
  table.sort(names)
  rr = rr + 1
  return names[rr % #names + 1]
end

local function route(txn, backend, key_chars)
  local session = txn.f:req_hdr("x-session-id")
  local kind, key
  if session and session ~= "" then
    kind, key = "session", session
  else
    local body = txn.f:req_body() or ""
    key = image_identity(body, tonumber(key_chars))
    if key then
      kind = "image"
    else
      key = user_field(body)
      kind = key and "user" or nil
    end
  end
  if key then
    txn:set_var("txn.vlmserve_route", kind)
    txn:set_var("txn.vlmserve_key", tostring(txn.c:xxh3(kind == "image" and key or kind .. ":" .. key)))
    return
  end
  txn:set_var("txn.vlmserve_route", "least-loaded")
  local pick = least_loaded(backend)
  if pick then
    txn:set_var("txn.vlmserve_pick", pick)
  end
end

core.register_action("vlmserve_route", { "http-req" }, route, 2)
