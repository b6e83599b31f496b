//! The verbs structures and constants `transport::rdma::abi` declares (instead of linking
//! rdma-sys) against the rdma-core headers installed on this machine: a C program built
//! with the system compiler prints every size, offset and constant, and each must equal the
//! Rust declaration. SKIPPED where no C compiler or no infiniband/verbs.h exists.

use mkernel::transport::rdma::abi::{constant_facts, layout_facts};
use std::path::Path;
use std::process::Command;

fn c_expression(fact: &str) -> String {
    match fact.strip_prefix("sizeof ") {
        Some(ty) => format!("sizeof(struct {ty})"),
        None => {
            let (ty, member) = fact.split_once('.').expect("type.member");
            format!("offsetof(struct {ty}, {member})")
        }
    }
}

#[test]
fn declared_layouts_match_the_installed_headers() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() || !Path::new("/usr/include/infiniband/efadv.h").exists()
    {
        // A missing header is a setup failure, not a pass: scripts/setup.sh installs them.
        panic!("no rdma-core headers (infiniband/verbs.h, efadv.h): install libibverbs-dev (scripts/setup.sh does)");
    }
    let dir = std::env::temp_dir().join(format!("mk_rdma_abi_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let layouts = layout_facts();
    let constants = constant_facts();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n#include <infiniband/efadv.h>\nint main(void) {\n",
    );
    for (name, _) in &layouts {
        c += &format!("  printf(\"%zu\\n\", (size_t){});\n", c_expression(name));
    }
    for (name, _) in &constants {
        c += &format!("  printf(\"%lld\\n\", (long long){name});\n");
    }
    c += "  return 0;\n}\n";
    let source = dir.join("abi.c");
    let binary = dir.join("abi");
    std::fs::write(&source, c).unwrap();
    let built = match Command::new("cc").arg(&source).arg("-o").arg(&binary).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED: no C compiler ({e})");
            return;
        }
    };
    assert!(built.status.success(), "the layout program does not build:\n{}", String::from_utf8_lossy(&built.stderr));
    let out = Command::new(&binary).output().unwrap();
    assert!(out.status.success());
    let values: Vec<i64> = String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(values.len(), layouts.len() + constants.len());
    let mut wrong = Vec::new();
    for ((name, ours), theirs) in
        layouts.iter().map(|&(n, v)| (n, v as i64)).chain(constants.iter().copied()).zip(&values)
    {
        if ours != *theirs {
            wrong.push(format!("{name}: declared {ours}, header says {theirs}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(wrong.is_empty(), "declarations differ from rdma-core's headers:\n{}", wrong.join("\n"));
}
