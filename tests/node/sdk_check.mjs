// Drives a live gateway with the openai Node SDK, changing only the base URL and the key.
// Usage: node sdk_check.mjs <base URL ending in /v1> <API key>
// Prints one JSON object: what the SDK returned for a chat, a stream and two embeddings.
import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 10_000 });
const messages = [{ role: "user", content: "hi" }];

const chat = await client.chat.completions.create({ model: "chat", messages });

const pieces = [];
let finish = null;
const stream = await client.chat.completions.create({ model: "chat", messages, stream: true });
for await (const chunk of stream) {
  const choice = chunk.choices[0];
  if (choice?.delta?.content) pieces.push(choice.delta.content);
  if (choice?.finish_reason) finish = choice.finish_reason;
}

const input = ["the tide", "turns at noon"];
// The SDK's default asks for base64 and decodes it into floats itself.
const byDefault = await client.embeddings.create({ model: "embed", input });
const asFloats = await client.embeddings.create({ model: "embed", input, encoding_format: "float" });

console.log(
  JSON.stringify({
    chat: { content: chat.choices[0].message.content, model: chat.model },
    stream: { text: pieces.join(""), finish },
    embeddings: {
      base64: byDefault.data.map((item) => Array.from(item.embedding)),
      float: asFloats.data.map((item) => item.embedding),
    },
  }),
);
