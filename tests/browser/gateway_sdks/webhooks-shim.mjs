// The Anthropic SDK imports `standardwebhooks` (for verifying webhooks on a server), which ships only
// as CommonJS: a browser cannot load it as an ES module, and a bundler would wrap it. Calls made from
// a page never verify webhooks, so this page maps the name to this stand-in.
export class Webhook {
  constructor() {
    throw new Error("webhook verification is not available in this test page");
  }
}
export class WebhookVerificationError extends Error {}
