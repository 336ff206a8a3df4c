-- llama3.lua — the Llama 3 decoder, written for one device (TorchTitan's
-- layout and parameter names). Parallelism is applied to it from outside.
--
--   tok_embeddings -> layers.N { attention_norm -> attention (GQA + RoPE) -> +x ;
--                                ffn_norm -> feed_forward (SwiGLU) -> +h } -> norm -> output
--
-- A flavor with `moe` settings (lua/models/moe.lua) puts a mixture of
-- experts, `layers.N.moe`, in place of the feed-forward of every
-- `moe_every`-th block (TorchTitan's Llama 4 interleave_moe_layer_step).
local titan = require("titan")
local moe = require("models.moe")
local nn, F = titan.nn, titan.F

local M = {}

-- TorchTitan's flavors. ffn hidden = round_up(multiplier * int(8 * dim / 3), multiple_of).
M.flavors = {
  debugmodel = { dim = 256, n_layers = 6, n_heads = 16, n_kv_heads = 16, multiple_of = 256, vocab_size = 2048,
    max_seq_len = 2048 },
  ["1B"] = { dim = 2048, n_layers = 16, n_heads = 32, n_kv_heads = 8, multiple_of = 1024, ffn_dim_multiplier = 1.5,
    vocab_size = 128256, tie_embeddings = true },
  ["3B"] = { dim = 3072, n_layers = 28, n_heads = 24, n_kv_heads = 8, multiple_of = 1024, ffn_dim_multiplier = 1.0,
    vocab_size = 128256, tie_embeddings = true },
  ["8B"] = { dim = 4096, n_layers = 32, n_heads = 32, n_kv_heads = 8, multiple_of = 1024, ffn_dim_multiplier = 1.3,
    vocab_size = 128256 },
  ["70B"] = { dim = 8192, n_layers = 80, n_heads = 64, n_kv_heads = 8, multiple_of = 4096, ffn_dim_multiplier = 1.3,
    vocab_size = 128256 },
  ["405B"] = { dim = 16384, n_layers = 126, n_heads = 128, n_kv_heads = 8, multiple_of = 4096,
    ffn_dim_multiplier = 1.2, vocab_size = 128256 },
  -- the debug model with 8 experts (top 1, sigmoid scores, a shared expert) in every block's
  -- feed-forward, as TorchTitan's Llama 4 debug model
  debugmodel_moe = { dim = 256, n_layers = 6, n_heads = 16, n_kv_heads = 16, multiple_of = 256, vocab_size = 2048,
    max_seq_len = 2048, moe = { num_experts = 8, top_k = 1, score_func = "sigmoid", num_shared_experts = 1 } },
}

local defaults = {
  n_kv_heads = nil, ffn_dim_multiplier = nil, norm_eps = 1e-5, rope_theta = 500000, max_seq_len = 8192,
  tie_embeddings = false, depth_init = true,
  -- Llama 3.1 frequency scaling
  rope_scaling = { factor = 8, low_freq_factor = 1, high_freq_factor = 4, original_max_seq = 8192 },
}

-- A flavor name or a table of overrides -> the complete model arguments.
function M.args(flavor, overrides)
  local base = type(flavor) == "table" and flavor or M.flavors[flavor]
  if not base then
    local names = {}
    for k in pairs(M.flavors) do names[#names + 1] = k end
    table.sort(names)
    error(("llama3: unknown flavor '%s'; expected one of %s"):format(tostring(flavor), table.concat(names, ", ")), 0)
  end
  local a = {}
  for k, v in pairs(defaults) do a[k] = v end
  for k, v in pairs(base) do a[k] = v end
  for k, v in pairs(overrides or {}) do a[k] = v end
  a.n_kv_heads = a.n_kv_heads or a.n_heads
  assert(a.dim % a.n_heads == 0, "llama3: dim must be a multiple of n_heads")
  assert(a.n_heads % a.n_kv_heads == 0, "llama3: n_heads must be a multiple of n_kv_heads")
  a.head_dim = a.dim / a.n_heads
  local hidden = math.floor(8 * a.dim / 3)
  if a.ffn_dim_multiplier then hidden = math.floor(a.ffn_dim_multiplier * hidden) end
  a.ffn_hidden = a.multiple_of * math.ceil(hidden / a.multiple_of)
  if a.moe then a.moe, a.moe_every = moe.args(a.moe), a.moe_every or 1 end
  return a
end

-- Whether block i (0-based) holds a mixture of experts.
function M.is_moe(a, i) return a.moe ~= nil and (i + 1) % a.moe_every == 0 end

-- ---- modules -----------------------------------------------------------------

local Attention = nn.Module:extend("Attention")
function Attention:init(a, opts)
  self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
  self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, opts)
  self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, opts)
  self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, opts)
  self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, opts)
end
-- (the head counts come from the projections' shapes, as TorchTitan's -1
-- views: under tensor parallelism a rank's wq/wk/wv hold its heads only)
function Attention:forward(x, rope)
  local B, T = x:size(1), x:size(2)
  local q = self.wq(x):view(B, T, -1, self.head_dim)
  local k = self.wk(x):view(B, T, -1, self.head_dim)
  local v = self.wv(x):view(B, T, -1, self.head_dim)
  rope = self:rope_slice(rope, T)
  q, k = F.rope(q, rope), F.rope(k, rope)
  return self.wo(self:sdpa(q, k, v):view(B, T, -1))
end

-- Slots a transform may replace on an instance (lua/parallel/ splits the
-- sequence over ranks so): the RoPE rows of x's T tokens, and the attention
-- of q, k, v [B, T, heads, head_dim] (causal, over the whole sequence).
function Attention:rope_slice(rope, T) return rope end
function Attention:sdpa(q, k, v) return F.attention(q, k, v, { causal = true }) end

local FeedForward = nn.Module:extend("FeedForward")
function FeedForward:init(a, opts)
  self.w1 = nn.Linear(a.dim, a.ffn_hidden, opts)
  self.w2 = nn.Linear(a.ffn_hidden, a.dim, opts)
  self.w3 = nn.Linear(a.dim, a.ffn_hidden, opts)
end
function FeedForward:forward(x) return self.w2(F.swiglu(self.w1(x), self.w3(x))) end

local Block = nn.Module:extend("TransformerBlock")
function Block:init(a, opts, i)
  self.attention_norm = nn.RMSNorm(a.dim, { eps = a.norm_eps, dtype = opts.dtype, device = opts.device })
  self.attention = Attention(a, opts)
  self.ffn_norm = nn.RMSNorm(a.dim, { eps = a.norm_eps, dtype = opts.dtype, device = opts.device })
  if M.is_moe(a, i) then self.moe = moe.MoE(a.dim, a.ffn_hidden, a.moe, opts)
  else self.feed_forward = FeedForward(a, opts) end
end
function Block:forward(x, rope)
  local h, f = self:forward_parts(x, nil, rope)
  return h + f
end

-- The block with its residual adds fused into the norms that read them:
-- the input is x + prev (prev: the previous block's feed-forward output,
-- nil for the first block), and it returns the residual h and its own
-- feed-forward output, which the next norm adds.
-- (:call("add_forward", ...) is norm:add_forward(...), named in a profile as the norm's call is)
function Block:forward_parts(x, prev, rope)
  local xn
  if prev then x, xn = self.attention_norm:call("add_forward", x, prev) else xn = self.attention_norm(x) end
  local h, hn = self.ffn_norm:call("add_forward", x, self.attention(xn, rope))
  return h, (self.moe or self.feed_forward)(hn)
end

local Transformer = nn.Module:extend("Llama3")
M.Transformer = Transformer

-- opts: device ("meta" to build without memory), dtype.
function Transformer:init(a, opts)
  opts = opts or {}
  self.args = a
  self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, opts)
  self.layers = nn.Module:extend("ModuleList")()
  for i = 0, a.n_layers - 1 do self.layers:child(tostring(i), Block(a, opts, i)) end
  self.norm = nn.RMSNorm(a.dim, { eps = a.norm_eps, dtype = opts.dtype, device = opts.device })
  if not a.tie_embeddings then self.output = nn.Linear(a.dim, a.vocab_size, opts) end
end

-- Rotary tables for the model's device, built on first use.
function Transformer:rope_tables(T)
  -- (a pipeline stage may hold no embedding: any of its weights tells the device)
  local w = self.tok_embeddings and self.tok_embeddings.weight
    or self.layers:named_children()[1][2].attention_norm.weight
  local dev = w:device()
  local dt = w:dtype() == "float64" and "float64" or "float32" -- RoPE runs in f32 at least
  local r = self._rope
  if not r or r.device ~= dev or r.max_seq < T or r.dtype ~= dt then
    if r then r.cos:free(); r.sin:free() end
    local a = self.args
    local n = math.max(T, a.max_seq_len)
    r = F.rope_tables(a.head_dim, n, a.rope_theta, a.rope_scaling, { device = dev, dtype = dt })
    r.dtype = dt
    titan.keep(r.cos); titan.keep(r.sin)
    r.device, r.max_seq = dev, n
    self._rope = r
  end
  return r
end

-- ids: int64 [B, T] -> logits [B, T, vocab]. A pipeline stage
-- (lua/parallel/pp.lua) holds some of the layers, as TorchTitan's: without
-- tok_embeddings it takes the previous stage's hidden state [B, T, dim]
-- (which stays the caller's), and without norm and output it returns its own.
function Transformer:forward(ids)
  local h = self.tok_embeddings and self.tok_embeddings(ids) or ids
  -- (the tables cover the sequence's positions: rope_positions, a slot)
  local rope = self:rope_tables(self:rope_positions(h:size(2)))
  local f
  for _, nl in ipairs(self.layers:named_children()) do
    local layer = nl[2]
    local h_prev, f_prev = h, f
    -- In its own scope, a block's temporaries go at its end, not the forward's.
    -- (The residual stream crosses a block boundary as two tensors, h + f,
    -- added in the next block's first norm; a block wrapped to keep only its
    -- input takes one, and returns f = nil: lua/parallel/ac.lua.)
    h, f = titan.scope(layer.call, layer, "forward_parts", h_prev, f_prev, rope) -- (a profile's layers.N)
    -- The tapes hold (shared) what the backward needs: the residual stream's
    -- handles can go now rather than when the caller's scope ends.
    if h_prev ~= ids then h_prev:free() end
    if f_prev then f_prev:free() end
  end
  if not self.norm then -- a stage before the last: one tensor goes to the next
    if not f then return h end
    local out = h + f
    if h ~= ids then h:free() end
    f:free()
    return out
  end
  if f then
    local _
    _, h = self.norm:call("add_forward", h, f)
  else
    h = self.norm(h)
  end
  local w = self.output and self.output.weight or self.tok_embeddings.weight
  return F.linear(h, w)
end

-- A slot: how many positions the RoPE tables must cover for h's T tokens
-- (a transform that splits the sequence over ranks makes it the whole's).
function Transformer:rope_positions(T) return T end

-- ---- tensor parallelism: what lua/parallel/tp.lua splits in a block --------------
M.tp_plan = {
  regions = { "attention", "feed_forward" },
  colwise = { "attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3" },
  rowwise = { "attention.wo", "feed_forward.w2" },
  -- sequence parallelism: the embedding's output is split along the sequence,
  -- the final norm's gathered; the blocks' norms see a chunk of the tokens each
  sequence = { enter = "tok_embeddings", exit = "norm", norms = { "attention_norm", "ffn_norm" } },
  -- loss parallelism: the output layer split by vocabulary rows (a tied flavor has none to split)
  output = "output",
  -- the embedding split by vocabulary rows (an untied flavor)
  embedding = "tok_embeddings",
  -- a mixture-of-experts block's layer, in place of feed_forward: whole on every rank, on the tokens it holds
  moe = "moe",
  -- each rank takes whole heads (and whole groups of query heads per kv head)
  check = function(a, tp)
    if a.n_kv_heads % tp ~= 0 then
      return ("n_kv_heads = %d is not a multiple of parallelism.tp = %d (each rank takes whole heads)")
        :format(a.n_kv_heads, tp)
    end
    if (not a.moe or a.moe_every > 1) and a.ffn_hidden % tp ~= 0 then
      return ("the feed-forward's %d hidden units are not a multiple of parallelism.tp = %d"):format(a.ffn_hidden, tp)
    end
  end,
}

-- ---- pipeline parallelism: what lua/parallel/pp.lua puts where ---------------
-- The first stage keeps `first`, the last keeps `last`; the blocks of
-- `layers` are split between the stages in order.
M.pp_plan = {
  layers = "layers", first = { "tok_embeddings" }, last = { "norm", "output" },
  check = function(a)
    if a.tie_embeddings then
      return "the flavor ties the output layer to the embedding (tie_embeddings), which the first and the last "
        .. "stage would both need; expected an untied flavor (e.g. 8B, debugmodel)"
    end
  end,
}

-- ---- initialization: rules are data ------------------------------------------

-- Each rule: a Lua pattern over the fully-qualified parameter name and the
-- initializer (with the layer number captured from the name when needed).
function M.init_rules(a)
  local function depth_std(layer)
    if a.depth_init then return 0.02 / math.sqrt(2 * (layer + 1)) end
    return 0.02 / math.sqrt(2 * a.n_layers)
  end
  local out_std = a.dim ^ -0.5
  local output_init = function() return { "trunc_normal", std = out_std, a = -3 * out_std, b = 3 * out_std } end
  return {
    -- Tied, the embedding is also the output layer: std 1 there would make
    -- the first logits ~sqrt(dim) times too large (a starting loss near dim
    -- instead of ln(vocab)), so it takes the output layer's init.
    { "^tok_embeddings%.weight$", a.tie_embeddings and output_init or function() return { "normal", std = 1.0 } end },
    { "^layers%.%d+%.attention%.w[qkv]%.weight$", function() return { "trunc_normal", std = 0.02 } end },
    { "^layers%.(%d+)%.attention%.wo%.weight$", function(l) return { "trunc_normal", std = depth_std(tonumber(l)) } end },
    { "^layers%.%d+%.feed_forward%.w1%.weight$", function() return { "trunc_normal", std = 0.02 } end },
    { "^layers%.(%d+)%.feed_forward%.w[23]%.weight$",
      function(l) return { "trunc_normal", std = depth_std(tonumber(l)) } end },
    -- mixture of experts: the router and each expert's w1 as the dense w1, their w2 and w3 by depth
    { "^layers%.%d+%.moe%.router%.weight$", function() return { "trunc_normal", std = 0.02 } end },
    { "^layers%.%d+%.moe%.[%w_.]*w1%.weight$", function() return { "trunc_normal", std = 0.02 } end },
    { "^layers%.(%d+)%.moe%.[%w_.]*w[23]%.weight$",
      function(l) return { "trunc_normal", std = depth_std(tonumber(l)) } end },
    { "norm%.weight$", function() return { "ones" } end },
    { "^output%.weight$", output_init },
  }
end

-- Apply the rules by name with the name-keyed RNG: the same weights for any
-- layout, device or construction order. only: a set of names to initialize
-- (FSDP initializes one block at a time); nil: all.
-- Parameter `name`'s initial values into t, which holds its elements from
-- `offset` on (0: the whole parameter; FSDP's shard of rows r0..: r0 times
-- the row's elements): the values a whole initialization gives them (each
-- element draws from the counter-based RNG at its own place).
function M.init_param(a, seed, name, t, offset)
  local spec
  for _, r in ipairs(M.init_rules(a)) do
    local cap = name:match(r[1])
    if cap then
      spec = r[2](cap)
      break
    end
  end
  if not spec then error("llama3: no init rule for parameter " .. name) end
  local key = nn.name_key(seed, name)
  titan.no_grad(function()
    if spec[1] == "normal" then t:normal_(0, spec.std, key, offset)
    elseif spec[1] == "ones" then t:fill_(1)
    else t:trunc_normal_(0, spec.std, spec.a or -2, spec.b or 2, key, offset) end
  end)
end

function M.init_weights(model, seed, only)
  for _, np in ipairs(model:named_parameters()) do
    if not only or only[np[1]] then M.init_param(model.args, seed, np[1], np[2], 0) end
  end
  -- (MoE's expert_bias buffers start at 0; a model built on meta and materialized holds garbage)
  titan.no_grad(function()
    for _, nb in ipairs(model:named_buffers()) do
      if nb[1]:match("expert_bias$") and not nb[2]:is_meta() then nb[2]:fill_(0) end
    end
  end)
  return model
end

-- Build: on meta (no memory) unless opts.device says otherwise; then
-- materialize + init when a real device is asked for.
function M.build(flavor, opts)
  opts = opts or {}
  local a = M.args(flavor, opts.overrides)
  local model = Transformer(a, { device = "meta", dtype = opts.dtype })
  if opts.device ~= "meta" then
    model:to_empty(opts.device or "cpu")
    M.init_weights(model, opts.seed or 0)
  end
  return model
end

-- Parameter counts and FLOPs per token as TorchTitan counts them:
-- 6 * (N - N_embedding) + 12 * L * H * Q * T (attention as if not causal),
-- with a tied embedding counted once, as the output matmul it also is.
function M.flops_per_token(model, seq_len)
  local a = model.args
  local n = model:num_parameters()
  local n_emb = model.tok_embeddings.weight:numel()
  -- The embedding lookup costs nothing, but tied, the same weight is also
  -- the output matmul, which does.
  local matmul_params = a.tie_embeddings and n or n - n_emb
  -- (a mixture of experts counts the experts a token runs: top_k of num_experts, as TorchTitan's)
  for _, l in ipairs(moe.layers(model)) do
    local routed = l[2].experts:num_parameters()
    matmul_params = matmul_params - routed * (1 - l[2].m.top_k / l[2].m.num_experts)
  end
  local flops = 6 * matmul_params + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
  return flops, n, n_emb
end

-- ---- the family's entry point for the trainer, the REPL and the config -----
-- How a job lays this family over its ranks (lua/parallel/llama3.lua: its
-- parallelize function) and the generic machinery around it
-- (lua/parallel/parallelize.lua), reached through here so that the library
-- (lua/titan) names no parallelism itself.
function M.parallelize(model, mesh, cfg, par) return require("parallel.llama3").parallelize(model, mesh, cfg, par) end
function M.parallel() return require("parallel.parallelize") end
-- The longest sequence a flavor trains on: its own max_seq_len, else Llama
-- 3.1's context window (RoPE scaled from 8192 positions).
M.CONTEXT = 131072
function M.check_config(cfg, need)
  local f = M.flavors[cfg.model.flavor]
  if f then
    local limit = f.max_seq_len or M.CONTEXT
    need(cfg.training.seq_len <= limit, ("training.seq_len = %d exceeds the context of %s %s (%d positions); "
      .. "expected at most %d"):format(cfg.training.seq_len, cfg.model.name, cfg.model.flavor, limit, limit))
  end
  return require("parallel.dims").check_config(cfg, need)
end

-- Mixture of experts: the number of experts of the model's MoE layers (0:
-- none), whether a parameter is an expert's, and the Linear layers whose
-- weights stay whole on every rank (a MoE layer's: no tp group for float8's scales).
function M.num_experts(model)
  local l = moe.layers(model)[1]
  return l and l[2].m.num_experts or 0
end
function M.is_expert(name) return name:find(".moe.experts.", 1, true) ~= nil end
function M.ungrouped_linear(model)
  local prefixes = {}
  for _, nl in ipairs(moe.layers(model)) do prefixes[#prefixes + 1] = nl[1] .. "." end
  return function(name)
    for _, p in ipairs(prefixes) do
      if name:sub(1, #p) == p then return true end
    end
    return false
  end
end

-- Hooks the trainer calls without knowing what they do.
M.hooks = {
  -- MoE's aux-loss-free balance (lua/models/moe.lua): each layer's expert
  -- bias moves by the step's token counts (summed over `counts`: the ranks
  -- that routed them) before the optimizer's step. Returns the log line's
  -- figure: the busiest expert's load over the mean, averaged over the layers.
  pre_optimizer_step = function(model, counts)
    local layers = moe.layers(model)
    if #layers == 0 then return nil end
    local load = 0
    for _, l in ipairs(layers) do load = load + moe.max_load(l[2]:update_bias(counts)) end
    return { moe_max_load = load / #layers }
  end,
}

return M
