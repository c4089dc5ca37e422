#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbite_fuzz::abi::run(data));
