#!/usr/bin/env node
// Schema check of rendered Kubernetes manifests without a cluster: Kubernetes' own OpenAPI models
// (kubernetes-models) for types, plus a strict walk for unknown fields, plus lossd's own policy.
//
// Usage: node validate.js [--source=NAME] FILE... ('-' reads stdin, called NAME in messages; a file
// may hold several YAML documents).
// Exit status: 0 when every document is valid, 1 when any is not, 2 on a usage or read error.
// Each problem is one line: "<file>: <Kind>/<name>: <field.path>: <what is wrong>".
'use strict';

const fs = require('fs');
const YAML = require('yaml');
const { checkPolicy } = require('./policy.js');

// The models' validators are ajv code compiled from the OpenAPI schemas without
// additionalProperties: false, so an unknown field (a typo such as `readinesProbe`) passes them.
// A Kubernetes API server would drop such a field silently (or reject it with strict field
// validation). To catch it here, the data is wrapped in proxies that record which properties the
// validator reads: the compiled code reads every property its schema declares, and enumerates
// the keys of maps (labels, data, limits). A key that was neither read nor enumerated in an
// object the validator did look into is unknown to the schema.
function track(value, seen) {
  if (value === null || typeof value !== 'object') return value;
  if (seen.has(value)) return seen.get(value).proxy;
  const record = { read: new Set(), enumerated: false, proxy: null };
  seen.set(value, record);
  record.proxy = new Proxy(value, {
    get(target, prop, receiver) {
      if (typeof prop === 'string') record.read.add(prop);
      const child = Reflect.get(target, prop, receiver);
      return Object.prototype.hasOwnProperty.call(target, prop) ? track(child, seen) : child;
    },
    has(target, prop) {
      if (typeof prop === 'string') record.read.add(prop);
      return Reflect.has(target, prop);
    },
    getOwnPropertyDescriptor(target, prop) {
      if (typeof prop === 'string') record.read.add(prop);
      return Reflect.getOwnPropertyDescriptor(target, prop);
    },
    ownKeys(target) {
      record.enumerated = true;
      return Reflect.ownKeys(target);
    },
  });
  return record.proxy;
}

function formatPath(segments) {
  let out = '';
  for (const s of segments) {
    if (typeof s === 'number' || /^\d+$/.test(s)) {
      out += `[${s}]`;
    } else if (/^[A-Za-z_][A-Za-z0-9_]*$/.test(s)) {
      out += out ? `.${s}` : s;
    } else {
      out += `[${JSON.stringify(s)}]`;
    }
  }
  return out || '(document)';
}

function unknownFields(value, seen, segments, out) {
  if (value === null || typeof value !== 'object') return;
  const record = seen.get(value);
  // Untouched: a free-form object (x-kubernetes-preserve-unknown-fields) or one the validator
  // never reached because its parent already has a type error. Neither can be judged here.
  if (!record) return;
  if (Array.isArray(value)) {
    value.forEach((item, i) => unknownFields(item, seen, segments.concat(i), out));
    return;
  }
  const lookedInside = record.enumerated || record.read.size > 0;
  for (const key of Object.keys(value)) {
    const here = segments.concat(key);
    if (lookedInside && !record.enumerated && !record.read.has(key)) {
      out.push({ path: formatPath(here), message: 'unknown field (not in the schema)' });
      continue;
    }
    unknownFields(value[key], seen, here, out);
  }
}

// apiVersion "apps/v1" -> kubernetes-models/apps/v1/<Kind>; "v1" -> kubernetes-models/v1/<Kind>;
// custom resources come from the packages listed after it.
const MODEL_PACKAGES = ['kubernetes-models', '@kubernetes-models/prometheus-operator'];

function findModel(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || !/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(apiVersion)) {
    return null;
  }
  if (typeof kind !== 'string' || !/^[A-Z][A-Za-z0-9]*$/.test(kind)) return null;
  for (const pkg of MODEL_PACKAGES) {
    let mod;
    try {
      mod = require(`${pkg}/${apiVersion}/${kind}`);
    } catch (err) {
      if (err.code === 'MODULE_NOT_FOUND' || err.code === 'ERR_PACKAGE_PATH_NOT_EXPORTED') continue;
      throw err;
    }
    const model = mod[kind];
    if (model && model.apiVersion === apiVersion && model.kind === kind) return model;
  }
  return null;
}

function schemaErrors(model, doc) {
  const seen = new Map();
  const out = [];
  try {
    // The model's validate() runs the compiled schema on `this`; calling it on the proxy (rather
    // than on `new Model(doc)`, which deep-copies) lets the walk see every read.
    model.prototype.validate.call(track(doc, seen));
  } catch (err) {
    if (!Array.isArray(err.errors)) throw err;
    // A oneOf (IntOrString, Quantity) fails once per branch; report it once, naming the types.
    const oneOfTypes = new Map();
    for (const e of err.errors) if (e.keyword === 'oneOf') oneOfTypes.set(e.instancePath, []);
    for (const e of err.errors) {
      if (e.keyword === 'type' && oneOfTypes.has(e.instancePath)) oneOfTypes.get(e.instancePath).push(e.params.type);
    }
    for (const e of err.errors) {
      if (e.keyword === 'type' && oneOfTypes.has(e.instancePath)) continue;
      const segments = e.instancePath.split('/').slice(1).map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'));
      const got = segments.reduce((v, s) => (v == null ? v : v[s]), doc);
      const gotText = `(got ${typeof got} ${JSON.stringify(got)})`;
      let message = e.message || e.keyword;
      if (e.keyword === 'oneOf' && oneOfTypes.get(e.instancePath).length > 0) {
        message = `must be ${oneOfTypes.get(e.instancePath).join(' or ')} ${gotText}`;
      } else if (e.keyword === 'enum') {
        message = `must be one of ${JSON.stringify(e.params.allowedValues)} ${gotText}`;
      } else if (e.keyword === 'type' || e.keyword === 'format') {
        message += ` ${gotText}`;
      }
      out.push({ path: formatPath(segments), message });
    }
  }
  unknownFields(doc, seen, [], out);
  return out;
}

function describe(doc) {
  const kind = doc && typeof doc.kind === 'string' ? doc.kind : '<no kind>';
  const name = doc && doc.metadata && typeof doc.metadata.name === 'string' ? doc.metadata.name : '<no name>';
  return `${kind}/${name}`;
}

// Returns the documents of one source and the problems found while parsing them.
function parseSource(source, text) {
  const docs = [];
  const problems = [];
  for (const parsed of YAML.parseAllDocuments(text, { uniqueKeys: true })) {
    for (const e of parsed.errors) problems.push(`${source}: YAML: ${e.message.split('\n')[0]}`);
    if (parsed.errors.length > 0) continue;
    const doc = parsed.toJS({ maxAliasCount: 100 });
    if (doc === null || doc === undefined) continue;
    if (typeof doc !== 'object' || Array.isArray(doc)) {
      problems.push(`${source}: a document must be a mapping, got ${Array.isArray(doc) ? 'a list' : typeof doc}`);
      continue;
    }
    docs.push({ source, doc });
  }
  return { docs, problems };
}

function validateDocuments(docs) {
  const problems = [];
  for (const { source, doc } of docs) {
    const model = findModel(doc.apiVersion, doc.kind);
    if (!model) {
      problems.push(`${source}: ${describe(doc)}: no schema for apiVersion ${JSON.stringify(doc.apiVersion)} kind ${JSON.stringify(doc.kind)}`);
      continue;
    }
    for (const p of schemaErrors(model, doc)) problems.push(`${source}: ${describe(doc)}: ${p.path}: ${p.message}`);
  }
  for (const p of checkPolicy(docs)) problems.push(`${p.source}: ${describe(p.doc)}: ${p.path}: ${p.message}`);
  return problems;
}

function main(argv) {
  // --source=NAME names stdin in messages (check passes the kustomization directory).
  let stdinName = '<stdin>';
  const files = [];
  for (const arg of argv) {
    if (arg.startsWith('--source=')) stdinName = arg.slice('--source='.length);
    else files.push(arg);
  }
  if (files.length === 0 || argv.includes('-h') || argv.includes('--help')) {
    process.stderr.write('usage: validate.js [--source=NAME] FILE... (- reads stdin, named NAME)\n');
    return 2;
  }
  const docs = [];
  const problems = [];
  for (const file of files) {
    let text;
    try {
      text = fs.readFileSync(file === '-' ? 0 : file, 'utf8');
    } catch (err) {
      process.stderr.write(`validate.js: cannot read ${file}: ${err.message}\n`);
      return 2;
    }
    const parsed = parseSource(file === '-' ? stdinName : file, text);
    docs.push(...parsed.docs);
    problems.push(...parsed.problems);
  }
  if (docs.length === 0 && problems.length === 0) problems.push(`${files.map((f) => (f === '-' ? stdinName : f)).join(' ')}: no Kubernetes objects found`);
  problems.push(...validateDocuments(docs));
  for (const p of problems) process.stdout.write(`ERROR ${p}\n`);
  if (problems.length > 0) {
    process.stdout.write(`${problems.length} problem(s) in ${docs.length} object(s)\n`);
    return 1;
  }
  process.stdout.write(`OK ${[...new Set(docs.map((d) => d.source))].join(' ')}: ${docs.length} object(s): ${docs.map((d) => describe(d.doc)).join(', ')}\n`);
  return 0;
}

module.exports = { validateDocuments, parseSource };

if (require.main === module) process.exitCode = main(process.argv.slice(2));
