-- moe.lua — a mixture-of-experts feed-forward (TorchTitan's models/moe.py,
-- as its Llama 4 and DeepSeek-V3 use it), for the model families to put in
-- place of a dense feed-forward:
--
--   out = shared_expert(x) + sum over the token's top_k experts e of  w_e * expert_e(x)
--
-- Router: scores = sigmoid or softmax of a bias-free linear layer's logits
-- ([tokens, num_experts]); each token goes to the top_k experts of scores +
-- expert_bias (the bias steers the choice only); its weights w are the
-- chosen experts' scores (renormalized to sum 1 with route_norm), times
-- route_scale. Each expert (and the shared one) is a SwiGLU feed-forward.
--
-- Load balance without an auxiliary loss (DeepSeek-V3's, TorchTitan's
-- load_balance_coeff): the layer counts the tokens each expert got during
-- the step, and before the optimizer step update_bias() moves expert_bias
-- by coeff * sign(mean count - count), centered, from the counts summed
-- over the data-parallel ranks: overloaded experts become less likely.
-- expert_bias is a buffer, saved in checkpoints.
--
-- Dispatch: the chosen experts' ids come to the host (a wait per layer on a
-- GPU), the (token, choice) pairs are put in expert order there, and the
-- tokens are gathered on the device (index_select), run expert by expert on
-- contiguous rows, and brought back to token order by the inverse
-- permutation, weighted and summed: every step has an autograd backward, so
-- the router learns through w. The experts' part is a slot a transform may
-- fill: self:run_experts(rows in expert order, counts per expert) -> their
-- outputs in that order (lua/parallel/ spreads the experts over ranks so,
-- sending the rows to the ranks holding theirs and back).
local titan = require("titan")
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local nn, F = titan.nn, titan.F

local M = {}

M.defaults = { num_experts = 8, top_k = 1, score_func = "sigmoid", route_norm = false, route_scale = 1.0,
  num_shared_experts = 1, load_balance_coeff = 1e-3 }

-- The complete settings: m's over M.defaults, checked.
function M.args(m)
  local a = {}
  for k, v in pairs(M.defaults) do a[k] = v end
  for k, v in pairs(m or {}) do a[k] = v end
  assert(a.top_k >= 1 and a.top_k <= a.num_experts, "moe: top_k must be between 1 and num_experts")
  assert(a.score_func == "sigmoid" or a.score_func == "softmax", "moe: score_func must be sigmoid or softmax")
  return a
end

local Expert = nn.Module:extend("Expert")
function Expert:init(dim, hidden, opts)
  self.w1 = nn.Linear(dim, hidden, opts)
  self.w2 = nn.Linear(hidden, dim, opts)
  self.w3 = nn.Linear(dim, hidden, opts)
end
function Expert:forward(x) return self.w2(F.swiglu(self.w1(x), self.w3(x))) end

local MoE = nn.Module:extend("MoE")
M.MoE = MoE

-- dim -> dim; hidden: each expert's hidden units; m: M.args's settings.
function MoE:init(dim, hidden, m, opts)
  self.m = M.args(m)
  local E = self.m.num_experts
  self.router = nn.Linear(dim, E, opts)
  self.experts = nn.Module:extend("ModuleList")()
  for e = 0, E - 1 do self.experts:child(tostring(e), Expert(dim, hidden, opts)) end
  if self.m.num_shared_experts > 0 then
    self.shared_expert = Expert(dim, hidden * self.m.num_shared_experts, opts)
  end
  self:buffer("expert_bias", titan.zeros({ E }, { dtype = "float32", device = opts and opts.device }))
  self.counts = {}
  for e = 1, E do self.counts[e] = 0 end
end

-- Chosen experts [N, k] (int64, on the device) and their weights [N, k] of
-- the routing scores (differentiable) for x2 [N, D].
function MoE:route(x2)
  local m = self.m
  local logits = self.router(x2)
  local scores = m.score_func == "softmax" and logits:softmax() or logits:sigmoid()
  local N = x2:size(1)
  -- (the selection's scratch, [N, E] scores and masks, is freed here, not at the step's end)
  local ids = memory.scope(titan.no_grad, function()
    local sel = (scores:detach():to("float32") + self.expert_bias:to("float32"):view(1, -1)):contiguous()
    local cols, mask = {}, titan.full({ N, 1 }, -math.huge, { dtype = "float32", device = sel:device() })
    for j = 1, m.top_k do
      cols[j] = sel:argmax(2, true) -- [N, 1]
      if j < m.top_k then sel:scatter_add_(2, cols[j], mask) end
    end
    return #cols == 1 and cols[1] or titan.cat(cols, 2)
  end)
  local w = scores:gather(2, ids)
  if m.route_norm then w = w / (w:sum(2, true) + 1e-20) end
  if m.route_scale ~= 1 then w = w * m.route_scale end
  return ids, w
end

function MoE:forward(x)
  local shape = x:shape()
  local D = shape[#shape]
  local x2 = x:reshape(-1, D)
  local N, k, E = x2:size(1), self.m.top_k, self.m.num_experts
  local ids, w = self:route(x2)
  -- (token, choice) pairs in expert order, stable: pair p = token * k + choice
  -- (on the meta device, a dry run's, the routing has no values: the pairs go round the experts, balanced)
  local flat
  if ids:is_meta() then
    flat = {}
    for p = 1, N * k do flat[p] = (p - 1) % E end
  else
    flat = ids:to("cpu"):tolist_flat()
  end
  local count, first = {}, {}
  for e = 1, E do count[e] = 0 end
  for p = 1, N * k do count[flat[p] + 1] = count[flat[p] + 1] + 1 end
  local off = 0
  for e = 1, E do first[e], off = off, off + count[e] end
  local order, pos, fill = {}, {}, {}
  for e = 1, E do fill[e] = first[e] end
  for p = 1, N * k do
    local e = flat[p] + 1
    order[fill[e] + 1] = math.floor((p - 1) / k) -- the token of the pair at this place
    pos[p] = fill[e]                             -- where pair p went
    fill[e] = fill[e] + 1
  end
  if self.training and not autograd.in_backward() then
    for e = 1, E do self.counts[e] = self.counts[e] + count[e] end
  end
  local dev = x2:device()
  local routed = x2:index_select(1, titan.tensor(order, { dtype = "int64" }):to(dev))
  local out
  if self.run_experts then -- (the slot: the experts run elsewhere)
    out = self:run_experts(routed, count)
  else
    local outs = {}
    for e = 1, E do
      if count[e] > 0 then
        outs[#outs + 1] = self.experts[tostring(e - 1)](routed:narrow(1, first[e] + 1, count[e]))
      end
    end
    out = titan.cat(outs, 1)
  end
  local back = out:index_select(1, titan.tensor(pos, { dtype = "int64" }):to(dev)) -- pair order
  local y = (back:view(N, k, D) * w:to(back:dtype()):view(N, k, 1)):sum(2)
  if self.shared_expert then y = y + self.shared_expert(x2) end
  return y:view(shape)
end

-- The aux-loss-free balance step (before the optimizer's): expert_bias +=
-- coeff * sign(mean - count), centered, with the counts summed over `group`
-- (the data-parallel ranks; nil: this rank's); the counts restart. Returns
-- the summed counts.
function MoE:update_bias(group)
  local E, coeff = self.m.num_experts, self.m.load_balance_coeff
  local c = group and group:sum_numbers(self.counts) or { unpack(self.counts) }
  for e = 1, E do self.counts[e] = 0 end
  if coeff <= 0 then return c end
  local mean = 0
  for e = 1, E do mean = mean + c[e] / E end
  local d, dm = {}, 0
  for e = 1, E do
    local s = mean - c[e]
    d[e] = coeff * (s > 0 and 1 or (s < 0 and -1 or 0))
    dm = dm + d[e] / E
  end
  for e = 1, E do d[e] = d[e] - dm end
  titan.no_grad(function()
    self.expert_bias:add_(titan.tensor(d, { dtype = "float32" }):to(self.expert_bias:device()))
  end)
  return c
end

-- The load of the busiest expert over the mean (1: balanced; num_experts:
-- one expert took every token) of counts.
function M.max_load(c)
  local mx, tot = 0, 0
  for _, v in ipairs(c) do mx, tot = math.max(mx, v), tot + v end
  return tot > 0 and mx * #c / tot or 1
end

-- The MoE layers of a model: { name, module } in order.
function M.layers(model)
  local out = {}
  for _, nm in ipairs(model:named_modules()) do
    if getmetatable(nm[2]).__name == "MoE" then out[#out + 1] = nm end
  end
  return out
end

return M
