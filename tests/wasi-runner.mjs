// Runs a wasm32-wasip1 test binary under Node's V8 with WASI preview 1 (cargo's runner for that
// target, see .cargo/config.toml), so `core` is tested inside a wasm VM like the filter's.
import { readFile } from "node:fs/promises";
import { argv, env, exit } from "node:process";
import { WASI } from "node:wasi";

const [, , wasmPath, ...args] = argv;
const wasi = new WASI({
  version: "preview1",
  args: [wasmPath, ...args],
  env,
  preopens: { "/": "/" },
  returnOnExit: true,
});
const module = await WebAssembly.compile(await readFile(wasmPath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance));
