-- Mistakes that must be named as the user's, in one line, at start: a
-- recipe that forgot its `return`, a sequence longer than the model's
-- context, recipe hooks returning the wrong thing, a checkpoint folder that
-- takes no files.
local F = dofile("tests/faults/faults.lua")
local sh = F.sh

-- A recipe file with `body` (Lua), based on the debug recipe.
local function recipe(body)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(body)
  f:close()
  return path
end

describe("a recipe", function()
  it("that builds its table but does not return it is refused, not run as a script that trains nothing", function()
    local r = recipe('local recipe = { base = "llama3_debugmodel", model = { flavor = "debugmodel" },\n'
      .. '  training = { steps = 3 } }\n')
    F.fails(("%s %s"):format(F.exe, r), ("titan: %s returned nothing, so nothing was trained; expected a recipe to end "
      .. "with `return { ... }`"):format(r))
    local base_only = recipe('local r = { base = "llama3_debugmodel" }\n')
    F.fails(("%s %s --training.steps=3"):format(F.exe, base_only), "returned nothing, so nothing was trained")
    os.remove(base_only)
    -- a plain script is still one, its arguments its own
    local script = recipe('print("a script", ...)\n')
    assert.are.equal("a script\t--training.steps=3\n", sh.run_ok(("%s %s --training.steps=3"):format(F.exe, script)))
    os.remove(r)
    os.remove(script)
  end)

  it("with a sequence longer than the model's context is refused at start", function()
    F.fails(F.train_cmd(sh.tmpdir(), { "--training.seq_len=1000000" }),
      "config: training.seq_len = 1000000 exceeds the context of llama3 debugmodel (2048 positions); expected at most "
      .. "2048")
  end)

  for _, c in ipairs({
    { "loss_fn returning nil", "loss_fn = function() end",
      "recipe: loss_fn returned nil; expected a scalar tensor" },
    { "loss_fn returning a number", "loss_fn = function() return 1.5 end",
      "recipe: loss_fn returned 1.5; expected a scalar tensor" },
    { "loss_fn returning the logits", "loss_fn = function(logits) return logits end",
      "recipe: loss_fn returned a tensor of shape [2, 16, 2048]; expected a scalar tensor" },
    { "train_step returning nothing", "train_step = function() end",
      "recipe: train_step returned nil; expected the step's loss as a number, then its tokens" },
    { "train_step without its tokens", "train_step = function() return 1.0 end",
      "recipe: train_step returned nil; expected the step's loss, then its number of tokens (a second value)" },
    { "build_data returning nothing", "build_data = function() end",
      "recipe: build_data returned nil; expected { train = loader, val = loader or nil }" },
  }) do
    it("hook " .. c[1] .. " is named, with what it must return", function()
      local r = recipe(('return { base = "llama3_debugmodel", %s }\n'):format(c[2]))
      F.fails(F.train_cmd(sh.tmpdir(), { "--training.steps=1" }, r), c[3])
      os.remove(r)
    end)
  end
end)

describe("a checkpoint folder", function()
  -- (/proc/self exists and takes no new file, even for root, as CI runs)
  it("that takes no files is refused at start, not at the first save", function()
    local out = F.fails(F.train_cmd(sh.tmpdir(), { "--training.steps=1", "--checkpoint.enable=true",
      "--checkpoint.folder=/proc/self" }), "checkpoint: cannot write into /proc/self (")
    assert.truthy(out:find("expected a writable checkpoint folder", 1, true), out)
    assert.falsy(out:find("step:", 1, true), out)
  end)
end)

describe("a seed checkpoint", function()
  it("with initial_load_path or load_step is refused (it would ignore them)", function()
    F.fails(F.train_cmd(sh.tmpdir(), { "--checkpoint.enable=true", "--checkpoint.create_seed_checkpoint=true",
      "--checkpoint.initial_load_path=/tmp/x" }), "checkpoint: checkpoint.create_seed_checkpoint writes freshly "
      .. "initialized weights as step 0, so initial_load_path = /tmp/x would be ignored; expected one or the other")
  end)
end)
