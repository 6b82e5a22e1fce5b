#!/usr/bin/env node
// Stream one completion from llmd over its Unix socket in JSON lines (Node's standard
// library only). Usage: node llmd-client.mjs [--socket PATH] [--max-tokens N]
// [--temperature T] PROMPT. Exit status: 0 done, 1 refused or failed, 3 llmd not running,
// 4 aborted (say by `llmctl abort`). Ctrl-C closes the connection, which aborts the request.
import { existsSync } from "node:fs";
import { createConnection } from "node:net";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

const { values: opt, positionals } = parseArgs({ allowPositionals: true, options: {
  socket: { type: "string" }, "max-tokens": { type: "string", default: "64" },
  temperature: { type: "string", default: "1" } } });
const runtimeDir = process.env.XDG_RUNTIME_DIR;  // the same search as llmd_client/socket_path.py
const socketPath = opt.socket ?? process.env.LLMD_SOCKET ?? (existsSync("/run/llmd/llmd.sock") || !runtimeDir
  ? "/run/llmd/llmd.sock" : `${runtimeDir}/llmd.sock`);

const conn = createConnection(socketPath, () => conn.write(JSON.stringify({ type: "submit", id: "1",
  prompt: positionals.join(" "),
  sampling: { max_tokens: Number(opt["max-tokens"]), temperature: Number(opt.temperature) } }) + "\n"));
conn.on("error", (err) => {
  console.error(`llmd: cannot connect to ${socketPath}: ${err.code}`);
  process.exit(["ENOENT", "ECONNREFUSED"].includes(err.code) ? 3 : 1);
});
process.exitCode = 1;  // unless the request ends well: the daemon may close the connection first
for await (const line of createInterface({ input: conn })) {  // one message per line
  const msg = JSON.parse(line);
  if (msg.type === "error") { console.error(`llmd: ${msg.code}: ${msg.message}`); break; }
  if (msg.type !== "output") continue;  // "accepted" carries the server's request_id
  process.stdout.write(msg.text ?? "");
  if (msg.finish_reason === "error") { console.error(`\nllmd: ${msg.error}`); break; }
  if (msg.usage) {  // only the request's last output carries usage
    process.stdout.write("\n");
    process.exitCode = msg.finish_reason === "abort" ? 4 : 0;
    break;
  }
}
conn.end();
