//! `protoc` as prost-build calls it (`--include_imports --include_source_info -o FILE
//! -I DIR... FILE...`), answered by protox: writes the encoded `FileDescriptorSet`.
//! Other `protoc` modes (code generators, `--decode`) are refused with a message.

use std::process::ExitCode;

use prost::Message;

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("protoc (protox): {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<(), String> {
    let (mut includes, mut files, mut out) = (Vec::new(), Vec::new(), None);
    let (mut imports, mut source_info) = (false, false);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut value = |flag: &str| it.next().ok_or(format!("{flag} needs a value"));
        match a.as_str() {
            "--version" => {
                println!("libprotoc 3.21.12 (protox)");
                return Ok(());
            }
            "-I" | "--proto_path" => includes.push(value(&a)?),
            "-o" | "--descriptor_set_out" => out = Some(value(&a)?),
            "--include_imports" => imports = true,
            "--include_source_info" => source_info = true,
            // Accepted by protoc 3.12–3.14 for proto3 `optional`; protox always allows it.
            "--experimental_allow_proto3_optional" => {}
            s if s.starts_with("--proto_path=") => includes.push(s["--proto_path=".len()..].into()),
            s if s.starts_with("-I") => includes.push(s[2..].into()),
            s if s.starts_with("--descriptor_set_out=") => {
                out = Some(s["--descriptor_set_out=".len()..].into())
            }
            s if s.starts_with("-o") => out = Some(s[2..].into()),
            s if s.starts_with('-') => {
                return Err(format!(
                    "{s} is not supported: only descriptor sets (-o) are written"
                ));
            }
            _ => files.push(a),
        }
    }
    let out = out.ok_or("no -o FILE: only descriptor sets are written")?;
    if includes.is_empty() {
        includes.push(".".into());
    }
    let mut compiler = protox::Compiler::new(&includes).map_err(|e| e.to_string())?;
    compiler.include_imports(imports);
    compiler.include_source_info(source_info);
    compiler.open_files(&files).map_err(|e| format!("{e:?}"))?;
    let set = compiler.file_descriptor_set();
    std::fs::write(&out, set.encode_to_vec()).map_err(|e| format!("writing {out}: {e}"))
}
