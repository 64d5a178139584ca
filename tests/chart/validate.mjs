// Validates Kubernetes objects offline, as an API server's schema check with unknown fields
// rejected would (what `kubeconform -strict` does):
//   1. each object against its kind's OpenAPI schema (kubernetes-models' validate()), and
//   2. a strict TypeScript pass over the objects typed as their kinds' interfaces, whose excess
//      property checks reject every field the schema does not name, at any depth.
//
//   node validate.mjs WORKDIR FILE.yaml...     (run with node_modules of tests/chart/package.json
//                                                next to WORKDIR's parent or in it)
// Prints one line per object; exits 1 on the first file set with an invalid or unknown object.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import YAML from "yaml";

const KINDS = {
  "v1/ConfigMap": ["kubernetes-models/v1/ConfigMap", "ConfigMap", "IConfigMap"],
  "v1/Pod": ["kubernetes-models/v1/Pod", "Pod", "IPod"],
  "v1/Secret": ["kubernetes-models/v1/Secret", "Secret", "ISecret"],
  "v1/Service": ["kubernetes-models/v1/Service", "Service", "IService"],
  "apps/v1/DaemonSet": ["kubernetes-models/apps/v1/DaemonSet", "DaemonSet", "IDaemonSet"],
  "apps/v1/Deployment": ["kubernetes-models/apps/v1/Deployment", "Deployment", "IDeployment"],
  "monitoring.coreos.com/v1/ServiceMonitor": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
    "ServiceMonitor", "IServiceMonitor"],
  "monitoring.coreos.com/v1/PodMonitor": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor",
    "PodMonitor", "IPodMonitor"],
};

const [work, ...files] = process.argv.slice(2);
if (!work || files.length === 0) {
  console.error("usage: node validate.mjs WORKDIR FILE.yaml...");
  process.exit(2);
}
fs.mkdirSync(work, { recursive: true });
const require = createRequire(path.join(path.resolve(work), "x.js"));

let failed = 0;
const imports = new Map();
const decls = [];
for (const file of files) {
  const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
  for (const doc of docs) {
    if (doc.errors.length) {
      console.error(`FAIL ${file}: YAML: ${doc.errors[0].message}`);
      failed++;
      continue;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    const key = `${obj.apiVersion}/${obj.kind}`;
    const what = `${file}: ${obj.kind} ${obj.metadata?.name ?? "(no name)"}`;
    const entry = KINDS[key];
    if (!entry) {
      console.error(`FAIL ${what}: no schema here for ${key} (add it to tests/chart/validate.mjs)`);
      failed++;
      continue;
    }
    const [module, cls, iface] = entry;
    const Model = require(module)[cls];
    try {
      new Model(obj).validate();
    } catch (e) {
      console.error(`FAIL ${what}: ${e.message}`);
      failed++;
      continue;
    }
    imports.set(iface, module);
    decls.push(`// ${what}\nexport const o${decls.length}: ${iface} = ${JSON.stringify(obj, null, 2)};\n`);
    console.log(`ok   ${what} (schema)`);
  }
}

// The strict pass: unknown fields are excess properties of the typed object literals.
const ts = [...imports].map(([i, m]) => `import type { ${i} } from "${m}";`).join("\n") +
  "\n\n" + decls.join("\n");
const tsFile = path.join(work, "objects.ts");
fs.writeFileSync(tsFile, ts);
const tsc = require.resolve("typescript/bin/tsc");
const { spawnSync } = await import("node:child_process");
const r = spawnSync(process.execPath, [tsc, "--noEmit", "--strict", "--skipLibCheck",
  "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2020", tsFile],
  { encoding: "utf8" });
if (r.status !== 0) {
  // Name the object of each error: the comment line above its declaration.
  const lines = ts.split("\n");
  for (const m of (r.stdout + r.stderr).split("\n").filter(Boolean)) {
    const at = /objects\.ts\((\d+),/.exec(m);
    let owner = "";
    if (at) {
      for (let l = Number(at[1]) - 1; l >= 0; l--) {
        if (lines[l].startsWith("// ")) { owner = lines[l].slice(3); break; }
      }
    }
    console.error(`FAIL ${owner ? owner + ": " : ""}${m.replace(/^.*objects\.ts/, "objects.ts")}`);
  }
  failed++;
} else {
  console.log(`ok   ${decls.length} objects have no field their kinds do not define (strict types)`);
}
process.exit(failed ? 1 : 0);
