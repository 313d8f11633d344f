// A real OpenID provider (panva/oidc-provider) for llmgw's single sign-on tests.
//
// It listens on 127.0.0.1 on a free port, prints "READY <issuer>" once it takes requests,
// and serves one confidential client. Its built-in development login form accepts any
// login name with any password: the name is looked up in the accounts file, which is
// read again on every lookup so that a test can change a person's groups between two
// sign-ins.
//
// Environment:
//   OIDC_CLIENT_ID, OIDC_CLIENT_SECRET   the client llmgw signs in as
//   OIDC_REDIRECT_URI                    llmgw's /oidc/callback/ URL
//   OIDC_POST_LOGOUT_REDIRECT_URI        where the provider sends people after signing out
//   OIDC_ACCOUNTS_FILE                   JSON: {"<login>": {"email": ..., "email_verified": ..., "name": ..., "groups": [...]}}
//   OIDC_PORT                            optional; 0 (the default) picks a free port

import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';

import Provider from 'oidc-provider';

function required(name) {
  const value = process.env[name];
  if (!value) {
    console.error(`${name} is not set`);
    process.exit(2);
  }
  return value;
}

const clientId = required('OIDC_CLIENT_ID');
const clientSecret = required('OIDC_CLIENT_SECRET');
const redirectUri = required('OIDC_REDIRECT_URI');
const postLogoutRedirectUri = required('OIDC_POST_LOGOUT_REDIRECT_URI');
const accountsFile = required('OIDC_ACCOUNTS_FILE');

function readAccounts() {
  return JSON.parse(readFileSync(accountsFile, 'utf8'));
}

async function findAccount(ctx, id) {
  const account = readAccounts()[id];
  if (!account) {
    return undefined;
  }
  return {
    accountId: id,
    async claims() {
      // Read again: the test may have changed the groups since the account was found.
      const current = readAccounts()[id] ?? account;
      return { sub: id, ...current };
    },
  };
}

const signingKey = generateKeyPairSync('rsa', { modulusLength: 2048 }).privateKey.export({ format: 'jwk' });

const server = createServer();
server.listen(Number(process.env.OIDC_PORT || 0), '127.0.0.1', () => {
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;
  const provider = new Provider(issuer, {
    clients: [
      {
        client_id: clientId,
        client_secret: clientSecret,
        redirect_uris: [redirectUri],
        post_logout_redirect_uris: [postLogoutRedirectUri],
        grant_types: ['authorization_code'],
        response_types: ['code'],
        // mozilla-django-oidc sends the secret in the form body unless told otherwise.
        token_endpoint_auth_method: 'client_secret_post',
      },
    ],
    findAccount,
    claims: {
      openid: ['sub'],
      email: ['email', 'email_verified'],
      profile: ['name', 'given_name', 'family_name'],
      groups: ['groups'],
    },
    scopes: ['openid', 'email', 'profile', 'groups'],
    jwks: { keys: [{ ...signingKey, kid: 'test-rs256', alg: 'RS256', use: 'sig' }] },
    cookies: { keys: [randomBytes(32).toString('hex')] },
    pkce: { required: () => true },
    features: {
      devInteractions: { enabled: true },
      rpInitiatedLogout: { enabled: true },
    },
  });
  server.on('request', provider.callback());
  console.log(`READY ${issuer}`);
});

for (const signal of ['SIGINT', 'SIGTERM']) {
  process.on(signal, () => process.exit(0));
}
