#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fleet_sidecar::fuzzing::quote(data));
