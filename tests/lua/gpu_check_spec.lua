-- scripts/gpu_check.sh, the parts that run without a GPU: the dry run, a bad
-- option, and how it pairs the cuDNN/NCCL/cuBLASLt libraries with their
-- headers (on fake installs in a scratch folder; the script is sourced, so
-- its functions run without its main step).
local script = "scripts/gpu_check.sh"

local shell = dofile("tests/lua/shell.lua")
local sh, q = shell.run, shell.quote

describe("gpu_check.sh", function()
  it("--dry-run executes nothing, exits 0 and lists every step with its timeout and log", function()
    local out, rc = sh("bash " .. script .. " --dry-run")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("nothing is executed", 1, true), out)
    for i, step in ipairs({ "probe", "unpack", "configure", "build", "cuda_tests", "bench_titan", "bench_torch",
      "cpu_tests" }) do
      assert.truthy(out:find(("%d%%. %s +timeout +%%d+s +log %%S+%%.log"):format(i, step)), step .. "\n" .. out)
    end
    assert.truthy(out:find("OUTDIR receives", 1, true), out)
  end)

  it("an unknown option is one line naming it and what is expected, exit 1", function()
    local out, rc = sh("bash " .. script .. " --frobnicate")
    assert.are.equal(1, rc)
    assert.are.equal("gpu_check: unknown option --frobnicate (expected --prepare, --dry-run or OUTDIR)\n", out)
  end)

  describe("find_cuda_libs", function()
    local root
    before_each(function()
      root = os.tmpname()
      os.remove(root)
      assert(os.execute("mkdir -p " .. q(root)) == 0)
    end)
    after_each(function() os.execute("rm -rf " .. q(root)) end)

    local function touch(rel)
      local path = root .. "/" .. rel
      assert(os.execute("mkdir -p " .. q(path:match("^(.*)/"))) == 0)
      assert(io.open(path, "w")):close()
    end

    -- A toolkit under root/cuda (a stand-in nvcc), wheels under root/py/nvidia. find_cuda_libs runs
    -- as the steps run it: in a fresh shell given only the functions $CUDA_HELPERS names.
    local function find()
      touch("cuda/bin/nvcc")
      os.execute("chmod +x " .. q(root .. "/cuda/bin/nvcc"))
      touch("py/nvidia/__init__.py")
      -- (no system folders: a real cuDNN or NCCL on this machine must not outvote the stand-ins)
      local out, rc = sh(("env PATH=%s:/usr/bin:/bin PYTHONPATH=%s GPU_CHECK_SYSTEM_LIBDIRS= GPU_CHECK_SYSTEM_INCDIRS= "
        .. "bash -c %s 2>&1"):format(q(root .. "/cuda/bin"),
        q(root .. "/py"), q("source " .. script .. " && MULTIARCH=$MULTIARCH bash -c \"$(declare -f $CUDA_HELPERS); "
          .. "find_cuda_libs && echo \\\"ARGS=\\$CUDA_CMAKE_ARGS\\\" && echo \\\"LIBDIRS=\\$CUDA_EXTRA_LIBDIRS\\\"\"")))
      assert.are.equal(0, rc, out)
      assert.falsy(out:find("command not found", 1, true), out)
      return out, out:match("ARGS=([^\n]*)"), out:match("LIBDIRS=([^\n]*)")
    end

    -- The script asks python3 where the nvidia wheels are.
    local has_python = select(2, sh("command -v python3")) == 0

    it("takes a wheel's library and header together over a toolkit library without its header", function()
      if not has_python then return pending("no python3 here: the wheels cannot be found") end
      touch("cuda/lib64/libcudnn.so") -- no cuda/include/cudnn.h
      touch("py/nvidia/cudnn/lib/libcudnn.so.9")
      touch("py/nvidia/cudnn/include/cudnn.h")
      touch("cuda/lib64/libnccl.so")
      touch("cuda/include/nccl.h")
      touch("cuda/lib64/libcublasLt.so")
      touch("cuda/include/cublasLt.h")
      local out, args, libdirs = find()
      assert.truthy(args:find("-DTITAN_CUDNN_LIBRARY=" .. root .. "/py/nvidia/cudnn/lib/libcudnn.so.9", 1, true), out)
      assert.truthy(args:find("-DTITAN_CUDNN_INCLUDE=" .. root .. "/py/nvidia/cudnn/include", 1, true), out)
      assert.truthy(args:find("-DTITAN_NCCL_LIBRARY=" .. root .. "/cuda/lib64/libnccl.so", 1, true), out)
      assert.truthy(args:find("-DTITAN_NCCL_INCLUDE=" .. root .. "/cuda/include", 1, true), out)
      assert.falsy(args:find("CUDA_cublasLt_LIBRARY", 1, true), out) -- in the toolkit: CMake finds it
      assert.are.equal(root .. "/py/nvidia/cudnn/lib", libdirs)
      assert.falsy(out:find("not one install", 1, true), out)
    end)

    it("says so when no install has both, and still names what it found", function()
      if not has_python then return pending("no python3 here: the wheels cannot be found") end
      touch("py/nvidia/nccl/lib/libnccl.so.2") -- the header only in the toolkit
      touch("cuda/include/nccl.h")
      touch("cuda/lib64/libcublasLt.so")
      touch("cuda/include/cublasLt.h")
      local out, args = find()
      assert.truthy(out:find("nccl +lib " .. root:gsub("%p", "%%%0") .. "/py/nvidia/nccl/lib/libnccl.so.2"), out)
      assert.truthy(out:find("not one install: the header and the library come from different places", 1, true), out)
      assert.truthy(args:find("-DTITAN_NCCL_INCLUDE=" .. root .. "/cuda/include", 1, true), out)
    end)
  end)
end)
