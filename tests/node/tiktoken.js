// Independent reference for the original Qwen's tokenizer (qwen.tiktoken):
// js-tiktoken (a JavaScript port of OpenAI's tiktoken, rank-based merges) fed
// the file's ranks, Qwen's special tokens and Qwen's split pattern, as
// Qwen's tokenization_qwen.py sets up tiktoken.Encoding.
//
//   node tests/node/tiktoken.js RANKS FILE          -> {"ids": [...]} of FILE's bytes
//   node tests/node/tiktoken.js RANKS --many FILE   -> FILE a JSON list of strings; a list of id lists
//
// Two adaptations, both to make the JS engine read the pattern as tiktoken's
// Rust regex (fancy-regex) does; neither changes what it means there:
//  - "(?i:'s|'t|...)" is spelled out with both cases (Node 20's RegExp has no
//    inline (?i:) group); 's' also folds to U+017F as in Rust's Unicode case folding;
//  - \s and \S are spelled out as Unicode White_Space (Rust's \s): JS's \s
//    lacks U+0085 and adds U+FEFF.
// Text: bytes decoded with TextDecoder (invalid UTF-8 -> U+FFFD) and NFC
// (tokenization_qwen.py normalises with unicodedata NFC before encoding),
// applied between special tokens, as qtune does.
"use strict";
const fs = require("fs");
const { Tiktoken } = require("js-tiktoken/lite");

const WS = "\\t\\n\\v\\f\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
const PAT =
  "(?:'[sS\\u017f]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|" +
  ` ?[^${WS}\\p{L}\\p{N}]+[\\r\\n]*|[${WS}]*[\\r\\n]+|[${WS}]+(?![^${WS}])|[${WS}]+`;

function load(ranksPath) {
  const lines = fs.readFileSync(ranksPath, "utf8").split("\n").filter(Boolean);
  let n = 0;
  const bpe = lines.map((l) => {
    const [b64, rank] = l.split(" ");
    n = Math.max(n, Number(rank) + 1);
    return `! ${rank} ${b64}`; // js-tiktoken's compact form: "_ OFFSET TOKEN..."
  });
  const special = { "<|endoftext|>": n, "<|im_start|>": n + 1, "<|im_end|>": n + 2 };
  for (let i = 0; i < 205; i++) special[`<|extra_${i}|>`] = n + 3 + i;
  return { enc: new Tiktoken({ pat_str: PAT, special_tokens: special, bpe_ranks: bpe.join("\n") }), special };
}

const args = process.argv.slice(2);
const { enc, special } = load(args[0]);
const names = Object.keys(special).sort((a, b) => b.length - a.length);
const splitter = new RegExp("(" + names.map((s) => s.replace(/[|<>]/g, "\\$&")).join("|") + ")");

function encode(text) {
  const nfc = text.split(splitter).map((p, i) => (i % 2 ? p : p.normalize("NFC"))).join("");
  return enc.encode(nfc, "all");
}

if (args[1] === "--many") {
  const texts = JSON.parse(fs.readFileSync(args[2], "utf8"));
  process.stdout.write(JSON.stringify(texts.map(encode)) + "\n");
} else {
  const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });
  process.stdout.write(JSON.stringify({ ids: encode(decoder.decode(fs.readFileSync(args[1]))) }) + "\n");
}
