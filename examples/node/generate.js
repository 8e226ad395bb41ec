#!/usr/bin/env node
// Streams a generation from the kvserve gateway over gRPC, loading the .proto files
// from the repository's protos/ directory at run time (no code generation).
//
//   node generate.js [--address 127.0.0.1:50051] [--max-tokens 32] [--temperature 0] "prompt text"
//
// Prints the text as it streams, then one JSON line with the summary:
//   {"request_id": ..., "text": ..., "num_tokens": N, "finish_reason": ..., "usage": {...}}
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");

function parseArgs(argv) {
  const options = { address: "127.0.0.1:50051", maxTokens: 32, temperature: 0, prompt: "Hello, my name is" };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--address") options.address = argv[++i];
    else if (arg === "--max-tokens") options.maxTokens = Number(argv[++i]);
    else if (arg === "--temperature") options.temperature = Number(argv[++i]);
    else positional.push(arg);
  }
  if (positional.length) options.prompt = positional.join(" ");
  return options;
}

function loadGateway() {
  const definition = protoLoader.loadSync("kvserve/v1/gateway.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).kvserve.v1.Gateway;
}

function main() {
  const options = parseArgs(process.argv.slice(2));
  const Gateway = loadGateway();
  const client = new Gateway(options.address, grpc.credentials.createInsecure());
  const request = {
    text: options.prompt,
    params: { max_tokens: options.maxTokens, temperature: options.temperature },
  };
  const summary = { request_id: "", text: "", num_tokens: 0, finish_reason: "", usage: null };
  const call = client.Generate(request);
  call.on("data", (message) => {
    summary.request_id = message.request_id;
    summary.text += message.text;
    summary.num_tokens += message.token_ids.length;
    process.stderr.write(message.text);
    if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED") summary.finish_reason = message.finish_reason;
    if (message.usage) summary.usage = message.usage;
  });
  call.on("error", (error) => {
    console.error(`\ngenerate failed: ${error.code} ${error.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    process.stderr.write("\n");
    console.log(JSON.stringify(summary));
    client.close();
  });
}

main();
