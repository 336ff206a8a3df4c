/*
 * main.c — the `titan` executable: LuaJIT with the library on its path.
 *
 *   titan SCRIPT.lua [ARGS...]   run a script (arg[0] = script, arg[1..] = ARGS)
 *   titan -e 'CODE'              run a chunk
 *   titan repl                   interactive prompt with the library loaded
 *   titan test [CTEST ARGS]      build, then run the whole suite through ctest
 *   titan busted FILES...        run busted specs inside this interpreter
 *   titan --nproc N ARGS...      the same ARGS in N processes (mpirun), one rank each
 *   titan --simulate N ARGS...   the same ARGS as N ranks simulated in this process
 *   titan --version | --help
 *
 * The classic Lua C API is used only here, at start-up, to set paths and
 * arguments; everything after that goes through the FFI.
 */
#include <errno.h>
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "titan.h"

static const char *tt_usage =
    "usage: titan SCRIPT.lua [ARGS...]   run a script with the library loaded\n"
    "       titan RECIPE.lua [--section.key=value ...] [--print-config] [--help]\n"
    "                                    train a recipe (--help: every config key, value and meaning)\n"
    "       titan RECIPE.lua --dry-run [...]  the job's start-up and two steps on the meta device: banner, estimate\n"
    "       titan estimate RECIPE.lua --world N [--device h100|h200|cpu] [--json] [...]\n"
    "                                    memory, FLOPs, communication and step time of a layout, no hardware\n"
    "       titan generate RECIPE.lua|CHECKPOINT_DIR --prompt TEXT   sample text from a model\n"
    "       titan ckpt inspect|verify|convert ...   checkpoints; Hugging Face import and export\n"
    "       titan data prepare|inspect ...          binary token files\n"
    "       titan tokenizer train|encode|decode|info ...   byte-level BPE tokenizers\n"
    "                                    (each: titan COMMAND --help)\n"
    "       titan -e 'CODE'              run a Lua chunk\n"
    "       titan repl                   interactive prompt (require \"titan\" is preloaded as `titan`)\n"
    "       titan test [CTEST ARGS...]   build and run the whole test suite (ctest)\n"
    "       titan busted SPEC...         run busted specs inside titan\n"
    "       titan --nproc N RECIPE.lua [...]   N ranks on this host (mpirun): data-parallel training\n"
    "       titan --simulate N RECIPE.lua [...]   N ranks simulated in this one process (the same numbers)\n"
    "       titan --version | --help\n"
    "environment: TITAN_HOME (source tree with lua/), OMP_NUM_THREADS, OPENBLAS_CORETYPE, TITAN_TRACEBACK=1\n";

static char tt_root[PATH_MAX];

/* The source tree: TITAN_HOME, else the parent of the build directory the
 * executable sits in, else the tree it was configured from. */
static void tt_find_root(void) {
  const char *home = getenv("TITAN_HOME");
  if (home && *home) {
    snprintf(tt_root, sizeof tt_root, "%s", home);
    return;
  }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = 0;
    for (int up = 0; up < 2; up++) {
      char *slash = strrchr(exe, '/');
      if (!slash) break;
      *slash = 0;
      char probe[PATH_MAX + 32];
      snprintf(probe, sizeof probe, "%s/lua/titan/init.lua", exe);
      if (access(probe, R_OK) == 0) {
        snprintf(tt_root, sizeof tt_root, "%s", exe);
        return;
      }
    }
  }
  snprintf(tt_root, sizeof tt_root, "%s", TITAN_SOURCE_DIR);
}

static int tt_traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = "(error object is not a string)";
  const char *tb = getenv("TITAN_TRACEBACK");
  if (tb && *tb && strcmp(tb, "0") != 0) {
    lua_getglobal(L, "debug");
    lua_getfield(L, -1, "traceback");
    lua_pushstring(L, msg);
    lua_pushinteger(L, 2);
    lua_call(L, 2, 1);
  } else {
    lua_pushstring(L, msg);
  }
  return 1;
}

static int tt_report(lua_State *L, int status) {
  if (status != 0) {
    const char *msg = lua_tostring(L, -1);
    if (msg && !*msg) { /* an empty error: another rank says why (rank 0, once for all) */
      lua_pop(L, 1);
      return status;
    }
    /* One of several ranks (mpirun, srun, simulated): say which, as only some may fail. */
    const char *rank = getenv("OMPI_COMM_WORLD_RANK"), *size = getenv("OMPI_COMM_WORLD_SIZE");
    if (!rank || !size) rank = getenv("SLURM_PROCID"), size = getenv("SLURM_NTASKS");
    char sim_rank[16], sim_size[16];
    if (tt_sim_world() > 0) {
      snprintf(sim_rank, sizeof sim_rank, "%d", tt_sim_rank());
      snprintf(sim_size, sizeof sim_size, "%d", tt_sim_world());
      rank = sim_rank, size = sim_size;
    }
    if (rank && size && atoi(size) > 1)
      fprintf(stderr, "titan (rank %s of %s): %s\n", rank, size, msg ? msg : "error");
    else
      fprintf(stderr, "titan: %s\n", msg ? msg : "error");
    lua_pop(L, 1);
  }
  return status;
}

static int tt_pcall(lua_State *L, int nargs) {
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, tt_traceback);
  lua_insert(L, base);
  int st = lua_pcall(L, nargs, 0, base);
  lua_remove(L, base);
  return st;
}

/* os.tmpname under TITAN_TEST_TMPDIR (mkstemp there, as LuaJIT's does in
 * /tmp): `titan test` points it at build/test-tmp, which it empties before
 * the suite and removes after a passing one, so the specs' dump folders and
 * checkpoints (gigabytes a run) do not pile up in /tmp. */
static int tt_test_tmpname(lua_State *L) {
  char path[PATH_MAX];
  int n = snprintf(path, sizeof path, "%s/lua_XXXXXX", getenv("TITAN_TEST_TMPDIR"));
  if (n < 0 || n >= (int)sizeof path) return luaL_error(L, "TITAN_TEST_TMPDIR is too long");
  int fd = mkstemp(path);
  if (fd < 0) return luaL_error(L, "unable to make a temporary file under TITAN_TEST_TMPDIR: %s", strerror(errno));
  close(fd);
  lua_pushstring(L, path);
  return 1;
}

static void tt_setup(lua_State *L, int argc, char **argv, int script_index) {
  luaL_openlibs(L);
  const char *test_tmp = getenv("TITAN_TEST_TMPDIR");
  if (test_tmp && *test_tmp) {
    lua_getglobal(L, "os");
    lua_pushcfunction(L, tt_test_tmpname);
    lua_setfield(L, -2, "tmpname");
    lua_pop(L, 1);
  }
  /* package.path: our lua/ first, then the system's (busted, penlight). */
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "path");
  char path[PATH_MAX * 3];
  snprintf(path, sizeof path, "%s/lua/?.lua;%s/lua/?/init.lua;%s", tt_root, tt_root, lua_tostring(L, -1));
  lua_pop(L, 1);
  lua_pushstring(L, path);
  lua_setfield(L, -2, "path");
  /* package.loaded["titan.env"]: where things are, for the Lua side. */
  lua_getfield(L, -1, "loaded");
  lua_newtable(L);
  lua_pushstring(L, tt_root);
  lua_setfield(L, -2, "root");
  lua_pushstring(L, TITAN_BUILD_DIR);
  lua_setfield(L, -2, "build_dir");
  lua_pushstring(L, argv[0]);
  lua_setfield(L, -2, "exe");
  lua_setfield(L, -2, "titan.env");
  lua_pop(L, 2);
  /* arg, as the standalone interpreter sets it. */
  lua_newtable(L);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script_index);
  }
  lua_setglobal(L, "arg");
}

/* Subcommands implemented in Lua: a file lua/titan/cli/<name>.lua. */
static int tt_lua_command(const char *name) {
  for (const char *p = name; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || *p == '_')) return 0;
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/lua/titan/cli/%s.lua", tt_root, name);
  return access(path, R_OK) == 0;
}

/* titan --nproc N ARGS...: this executable N times under mpirun, each rank
 * with its share of the cores. Ranks learn their place from mpirun's
 * environment (lua/titan/dist.lua); under mpirun or srun directly, the
 * same happens without this. */
static int tt_launch(int argc, char **argv, const char *count, int first) {
  char *end = NULL;
  long n = strtol(count, &end, 10);
  if (!*count || *end || n < 1 || n > 4096) {
    fprintf(stderr, "titan: --nproc '%s': expected a number of processes from 1 to 4096\n", count);
    return 1;
  }
  if (first >= argc) {
    fprintf(stderr, "titan: --nproc %ld needs what to run (e.g. titan --nproc %ld RECIPE.lua)\n", n, n);
    return 1;
  }
  char exe[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) snprintf(exe, sizeof exe, "%s", argv[0]);
  else exe[len] = 0;
  /* Each rank's OpenMP and OpenBLAS threads: the cores shared out, unless set. */
  if (!getenv("OMP_NUM_THREADS")) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN), per = cores > n ? cores / n : 1;
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", per);
    setenv("OMP_NUM_THREADS", buf, 1);
  }
  char **av = calloc((size_t)argc + 16, sizeof *av);
  if (!av) return 1;
  int k = 0;
  if (n == 1) {
    av[k++] = exe;
  } else {
    /* (root in a container, as CI runs: Open MPI refuses root unless told) */
    if (geteuid() == 0) {
      setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
      setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    }
    /* Open MPI's shared-memory single copy (CMA) needs ptrace rights that
     * containers often lack, and then fails mid-job; the copy-in/copy-out
     * path costs little at these sizes. An explicit setting wins. */
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    static char np[32];
    snprintf(np, sizeof np, "%ld", n);
    av[k++] = "mpirun";
    av[k++] = "-np";
    av[k++] = np;
    av[k++] = "--oversubscribe"; /* more ranks than cores still runs (slowly) */
    av[k++] = "--bind-to";
    av[k++] = "none"; /* each rank's threads pick their cores */
    av[k++] = "-x";
    av[k++] = "OMP_NUM_THREADS";
    av[k++] = exe;
  }
  for (int i = first; i < argc; i++) av[k++] = argv[i];
  av[k] = NULL;
  fflush(stdout);
  execvp(av[0], av);
  fprintf(stderr, "titan: --nproc %ld: cannot run %s (%s)%s\n", n, av[0], strerror(errno),
          n > 1 ? "; multi-process runs need Open MPI: apt-get install openmpi-bin libopenmpi-dev" : "");
  free(av);
  return 1;
}

static int tt_run_string(lua_State *L, const char *code, const char *name) {
  int st = luaL_loadbuffer(L, code, strlen(code), name);
  if (st == 0) st = tt_pcall(L, 0);
  return tt_report(L, st);
}

/* Everything but the launchers: a Lua state runs the command line. Returns
 * 0 or 1. Under --simulate every simulated rank runs it on its own state. */
static int tt_run_lua(int argc, char **argv) {
  lua_State *L = luaL_newstate();
  if (!L) {
    fprintf(stderr, "titan: cannot create the Lua state (out of memory)\n");
    return 1;
  }
  int st;
  if (!strcmp(argv[1], "-e")) {
    if (argc < 3) {
      fprintf(stderr, "titan: -e needs a chunk of Lua code\n");
      lua_close(L);
      return 1;
    }
    tt_setup(L, argc, argv, 2);
    st = tt_run_string(L, argv[2], "=(command line)");
  } else if (!strcmp(argv[1], "repl")) {
    tt_setup(L, argc, argv, 1);
    st = tt_run_string(L, "require('titan.repl').run()", "=repl");
  } else if (tt_lua_command(argv[1])) {
    /* titan tokenizer|data|generate|ckpt ...: commands written in Lua
     * (lua/titan/cli/<name>.lua), arg[1..] = the rest of the line. */
    tt_setup(L, argc, argv, 1);
    char code[256];
    snprintf(code, sizeof code, "return require('titan.cli.%s').main(...)", argv[1]);
    st = luaL_loadbuffer(L, code, strlen(code), "=titan");
    if (st == 0) {
      for (int i = 2; i < argc; i++) lua_pushstring(L, argv[i]);
      st = tt_pcall(L, argc - 2);
    }
    st = tt_report(L, st);
  } else if (!strcmp(argv[1], "busted")) {
    tt_setup(L, argc, argv, 1);
    st = tt_run_string(L, "require('busted.runner')({ standalone = false })", "=busted");
  } else {
    const char *script = argv[1];
    if (access(script, R_OK) != 0) {
      fprintf(stderr, "titan: cannot read script '%s' (expected a Lua file or a command; see titan --help)\n", script);
      lua_close(L);
      return 1;
    }
    tt_setup(L, argc, argv, 1);
    /* A script that returns a table is a recipe: it is trained, with the
     * rest of the command line as config overrides. */
    static const char *run_script =
        "local path = ...\n"
        "local chunk, err = loadfile(path)\n"
        "if not chunk then error(err, 0) end\n"
        "local result = chunk(select(2, ...))\n"
        "if type(result) == 'table' then\n"
        "  require('titan.trainer').run(result, { select(2, ...) })\n"
        "elseif result == nil then\n"
        "  require('titan.config').check_script_result(path)\n"
        "end\n";
    st = luaL_loadbuffer(L, run_script, strlen(run_script), "=titan");
    if (st == 0) {
      /* ... = the script's path then its arguments, as in lua(1). */
      for (int i = 1; i < argc; i++) lua_pushstring(L, argv[i]);
      st = tt_pcall(L, argc - 1);
    }
    st = tt_report(L, st);
  }
  lua_close(L); /* (frees the process groups first) */
  return st ? 1 : 0;
}

struct tt_sim_job {
  int argc;
  char **argv;
};

static int tt_sim_rank_main(int rank, int world, void *arg) {
  (void)rank, (void)world;
  struct tt_sim_job *job = arg;
  return tt_run_lua(job->argc, job->argv);
}

/* titan --simulate N ARGS...: N ranks of one job in this process (engine/
 * sim.c), each on its own Lua state, joined by the "local" collectives
 * backend: the numbers of `titan --nproc N ARGS...` without N processes. */
static int tt_simulate(int argc, char **argv, const char *count, int first) {
  char *end = NULL;
  long n = strtol(count, &end, 10);
  if (!*count || *end || n < 1 || n > 4096) {
    fprintf(stderr, "titan: --simulate '%s': expected a number of ranks from 1 to 4096\n", count);
    return 1;
  }
  if (first >= argc) {
    fprintf(stderr, "titan: --simulate %ld needs what to run (e.g. titan --simulate %ld RECIPE.lua)\n", n, n);
    return 1;
  }
  if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("SLURM_NTASKS")) {
    const char *w = getenv("OMPI_COMM_WORLD_SIZE");
    if (!w) w = getenv("SLURM_NTASKS");
    if (atoi(w) > 1) {
      fprintf(stderr, "titan: --simulate inside a launched job of %s ranks; expected one process (drop mpirun/srun or "
              "--simulate)\n", w);
      return 1;
    }
  }
  char **av = calloc((size_t)argc + 1, sizeof *av);
  if (!av) return 1;
  int k = 0;
  av[k++] = argv[0];
  for (int i = first; i < argc; i++) av[k++] = argv[i];
  av[k] = NULL;
  struct tt_sim_job job = { k, av };
  int failed = -1;
  tt_status st = tt_sim_run((int)n, tt_sim_rank_main, &job, &failed);
  free(av);
  if (st != TT_OK && failed < 0) fprintf(stderr, "titan: %s\n", tt_last_error());
  return st == TT_OK ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    fputs(tt_usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 1 : 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("titan %s\n", tt_version());
    printf("blas: %s\n", tt_blas_info());
    printf("threads: %d\n", tt_num_threads());
    printf("mpi: %s\n", tt_dist_mpi_info());
    printf("cuda: %s (%d device%s)\n",
#ifdef TITAN_HAVE_CUDA
           "built",
#else
           "not built",
#endif
           tt_cuda_device_count(), tt_cuda_device_count() == 1 ? "" : "s");
    if (tt_cuda_device_count() > 0) {
      printf("      %s\n", tt_cuda_info());
      for (int i = 0; i < tt_cuda_device_count(); i++) {
        int64_t free_b = 0, total_b = 0;
        tt_device dev = {TT_CUDA, i};
        if (tt_device_memory_info(dev, &free_b, &total_b) == TT_OK)
          printf("      cuda:%d: %.1f GiB, %.1f GiB free\n", i, total_b / 1073741824.0, free_b / 1073741824.0);
        else
          printf("      cuda:%d: %s\n", i, tt_last_error());
      }
    }
    return 0;
  }
  if (!strcmp(argv[1], "--nproc")) return tt_launch(argc, argv, argc > 2 ? argv[2] : "", 3);
  if (!strncmp(argv[1], "--nproc=", 8)) return tt_launch(argc, argv, argv[1] + 8, 2);
  if (!strcmp(argv[1], "--simulate") || !strncmp(argv[1], "--simulate=", 11)) {
    tt_find_root();
    int eq = argv[1][10] == '=';
    return tt_simulate(argc, argv, eq ? argv[1] + 11 : (argc > 2 ? argv[2] : ""), eq ? 2 : 3);
  }
  tt_find_root();
  if (!strcmp(argv[1], "test")) {
    /* Build first (a no-op when nothing changed), then ctest, the specs'
     * temporary files under build/test-tmp (tt_test_tmpname): emptied
     * first, removed when every test passed, kept for a look otherwise.
     * One test at a time: most use every core already (OpenMP's threads,
     * or ranks), and two at once oversubscribe them (OpenMP's waits spin:
     * a 2-core run took twice the CPU time). */
    char cmd[PATH_MAX * 4 + 1024];
    int n = snprintf(cmd, sizeof cmd,
                     "cmake --build '%s' --parallel >/dev/null && rm -rf '%s/test-tmp' && mkdir -p '%s/test-tmp' && "
                     "TITAN_TEST_TMPDIR='%s/test-tmp' ctest --test-dir '%s' --output-on-failure",
                     TITAN_BUILD_DIR, TITAN_BUILD_DIR, TITAN_BUILD_DIR, TITAN_BUILD_DIR, TITAN_BUILD_DIR);
    for (int i = 2; i < argc && n < (int)sizeof cmd - 64; i++) n += snprintf(cmd + n, sizeof cmd - n, " '%s'", argv[i]);
    if (n < (int)sizeof cmd - 64)
      snprintf(cmd + n, sizeof cmd - n, " && rm -rf '%s/test-tmp'", TITAN_BUILD_DIR);
    int rc = system(cmd);
    return rc == -1 ? 1 : (WIFEXITED(rc) ? WEXITSTATUS(rc) : 1);
  }

  int st = tt_run_lua(argc, argv);
  tt_dist_shutdown(st != 0);
  return st;
}
