-- The debug recipe with validation data that ends after one batch on
-- data-parallel rank 0 and after three on the others (a recipe's own data
-- may split unevenly): tests/lua/mpi_spec.lua checks that the ranks stop
-- validating together instead of waiting on each other in a collective.
local r = dofile("lua/recipes/llama3_debugmodel.lua")
r.build_data = function(cfg, tok, opts)
  local d = require("titan.data").build(cfg, tok, opts)
  local val, left = d.val, nil
  d.val = {
    next = function()
      left = left or (opts.rank == 0 and 1 or 3)
      if left == 0 then return nil end
      left = left - 1
      return val:next()
    end,
    reset = function()
      left = nil
      if val.reset then val:reset() end
    end,
  }
  return d
end
return r
