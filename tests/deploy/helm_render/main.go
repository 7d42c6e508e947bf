// Command helm_render renders a Helm chart the way `helm template` does, for the test suite
// (tests/deploy/test_helm.py renders deploy/helm/tidegate with it).
//
// Why it exists: helm cannot be installed on CI (it is not packaged by Debian nor on PyPI, and
// its downloads are out of reach), but helm's template engine is Go's text/template with the
// sprig v3 functions, and Debian packages both. This is that engine with helm's own functions
// (include, required, toYaml, fromYaml, toJson, fromJson, tpl), helm's merging of values files
// over values.yaml (maps merge key by key, null deletes), the values checked against
// values.schema.json first, and every rendered document parsed as YAML. It always runs as
// `helm lint --strict` does: a missing key is an error, not an empty string. Where helm exists,
// `helm lint` and `helm template` are the real checks (docs/deploy.md, "Helm").
//
// Build with Debian's golang-go, golang-github-masterminds-sprig-dev and
// golang-gopkg-yaml.v3-dev, in GOPATH mode:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o helm_render .
//
// Use: helm_render [--name RELEASE] [--namespace NS] [--notes] [-f VALUES.yaml]... CHART_DIR
// It prints the documents separated by `---`, each after a `# Source:` line (with --notes, the
// rendered NOTES.txt instead), or the error and exits 1.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v3"
)

type files []string

func (f *files) String() string     { return strings.Join(*f, ",") }
func (f *files) Set(v string) error { *f = append(*f, v); return nil }

func main() {
	var overrides files
	name := flag.String("name", "release-name", "the release name")
	namespace := flag.String("namespace", "default", "the release namespace")
	notes := flag.Bool("notes", false, "print the rendered NOTES.txt instead of the manifests")
	flag.Var(&overrides, "f", "a values file merged over values.yaml (repeatable)")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: helm_render [--name R] [--namespace NS] [--notes] [-f values.yaml]... CHART")
		os.Exit(2)
	}
	out, err := render(flag.Arg(0), *name, *namespace, overrides, *notes)
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
	fmt.Print(out)
}

// readYAML reads a YAML file as helm does (through JSON: every number is a float64).
func readYAML(path string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var data interface{}
	if err := yaml.Unmarshal(raw, &data); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	m := map[string]interface{}{}
	if data != nil {
		if err := viaJSON(data, &m); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return m, nil
}

func viaJSON(in interface{}, out interface{}) error {
	raw, err := json.Marshal(in)
	if err != nil {
		return err
	}
	return json.Unmarshal(raw, out)
}

// merge puts src over dst as helm does with values files: maps merge, null deletes a key.
func merge(dst, src map[string]interface{}) {
	for k, v := range src {
		if v == nil {
			delete(dst, k)
			continue
		}
		if sm, ok := v.(map[string]interface{}); ok {
			if dm, ok := dst[k].(map[string]interface{}); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// toYAML is helm's toYaml: JSON first (sigs.k8s.io/yaml), so numbers print as JSON numbers.
func toYAML(v interface{}) string {
	raw, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	var plain interface{}
	if err := yaml.Unmarshal(raw, &plain); err != nil {
		return ""
	}
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(plain); err != nil {
		return ""
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	var data interface{}
	if err := yaml.Unmarshal([]byte(s), &data); err != nil {
		m["Error"] = err.Error()
	} else if err := viaJSON(data, &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func toJSON(v interface{}) string {
	raw, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(raw)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func required(msg string, v interface{}) (interface{}, error) {
	if s, ok := v.(string); v == nil || (ok && s == "") {
		return v, errors.New(msg)
	}
	return v, nil
}

func render(chart, name, namespace string, overrides []string, notes bool) (string, error) {
	meta, err := readYAML(filepath.Join(chart, "Chart.yaml"))
	if err != nil {
		return "", err
	}
	values, err := readYAML(filepath.Join(chart, "values.yaml"))
	if err != nil {
		return "", err
	}
	for _, path := range overrides {
		override, err := readYAML(path)
		if err != nil {
			return "", err
		}
		merge(values, override)
	}
	if schema, err := readJSON(filepath.Join(chart, "values.schema.json")); err == nil {
		var problems []string
		check(schema, values, "", &problems)
		if len(problems) > 0 {
			sort.Strings(problems)
			return "", fmt.Errorf("values don't meet the specifications of the schema:\n- %s", strings.Join(problems, "\n- "))
		}
	} else if !os.IsNotExist(err) {
		return "", err
	}
	chartName, _ := meta["name"].(string)
	top := map[string]interface{}{
		"Values":  values,
		"Release": map[string]interface{}{"Name": name, "Namespace": namespace, "Service": "Helm", "IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Chart": map[string]interface{}{
			"Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"],
			"Description": meta["description"], "Type": meta["type"], "APIVersion": meta["apiVersion"],
		},
	}

	// As helm's engine: one template set holding every file, named CHART/templates/FILE.
	tpl := template.New("gotpl").Option("missingkey=error")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env")
	delete(funcs, "expandenv")
	funcs["toYaml"], funcs["fromYaml"] = toYAML, fromYAML
	funcs["toJson"], funcs["fromJson"] = toJSON, fromJSON
	funcs["required"] = required
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var buf strings.Builder
		err := tpl.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := tpl.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf strings.Builder
		err = t.Execute(&buf, data)
		return buf.String(), err
	}
	tpl.Funcs(funcs)
	paths, err := filepath.Glob(filepath.Join(chart, "templates", "*"))
	if err != nil {
		return "", err
	}
	sort.Strings(paths)
	var names []string
	for _, path := range paths {
		text, err := os.ReadFile(path)
		if err != nil {
			return "", err
		}
		name := chartName + "/templates/" + filepath.Base(path)
		if _, err := tpl.New(name).Parse(string(text)); err != nil {
			return "", err
		}
		if !strings.HasPrefix(filepath.Base(path), "_") {
			names = append(names, name)
		}
	}

	var out strings.Builder
	separator := regexp.MustCompile(`(?m)^---[ \t]*$`)
	for _, name := range names {
		isNotes := strings.HasSuffix(name, "/NOTES.txt")
		top["Template"] = map[string]interface{}{"Name": name, "BasePath": chartName + "/templates"}
		var buf strings.Builder
		if err := tpl.ExecuteTemplate(&buf, name, top); err != nil {
			return "", cleanup(err)
		}
		if isNotes != notes {
			continue
		} else if notes {
			out.WriteString(buf.String())
			continue
		}
		for _, doc := range separator.Split(buf.String(), -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var parsed interface{}
			if err := yaml.Unmarshal([]byte(doc), &parsed); err != nil {
				return "", fmt.Errorf("YAML parse error on %s: %w", name, err)
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", name, strings.Trim(doc, "\n"))
		}
	}
	return out.String(), nil
}

// cleanup shortens a `fail` or `required` error to its message, as helm does.
func cleanup(err error) error {
	tokens := strings.SplitN(err.Error(), ": ", 3)
	parts := regexp.MustCompile(`error calling (?:fail|required): (.*)$`).FindStringSubmatch(err.Error())
	if len(tokens) == 3 && parts != nil {
		return fmt.Errorf("execution error at (%s): %s", tokens[1], parts[1])
	}
	return err
}

func readJSON(path string) (map[string]interface{}, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	m := map[string]interface{}{}
	return m, json.Unmarshal(raw, &m)
}

// check appends each way v breaks a JSON schema (draft-07's keywords this chart's schema uses;
// an unknown keyword is a problem too, so the schema cannot use one that is silently ignored).
func check(schema map[string]interface{}, v interface{}, at string, problems *[]string) {
	where := at
	if where == "" {
		where = "(root)"
	}
	fail := func(format string, args ...interface{}) {
		*problems = append(*problems, where+": "+fmt.Sprintf(format, args...))
	}
	if types, ok := schema["type"]; ok {
		wanted := []interface{}{types}
		if list, ok := types.([]interface{}); ok {
			wanted = list
		}
		given := jsonType(v)
		match := false
		for _, t := range wanted {
			match = match || t == given || (t == "number" && given == "integer")
		}
		if !match {
			fail("invalid type: expected %v, given %s", types, given)
			return
		}
	}
	m, isMap := v.(map[string]interface{})
	list, isList := v.([]interface{})
	s, isString := v.(string)
	n, isNumber := v.(float64)
	for key, rule := range schema {
		switch key {
		case "$schema", "title", "description", "default", "examples", "$comment", "type":
		case "properties":
			for prop, sub := range rule.(map[string]interface{}) {
				if value, ok := m[prop]; ok && isMap {
					check(sub.(map[string]interface{}), value, join(at, prop), problems)
				}
			}
		case "additionalProperties":
			if !isMap {
				continue
			}
			declared, _ := schema["properties"].(map[string]interface{})
			for prop, value := range m {
				if _, ok := declared[prop]; ok {
					continue
				}
				if sub, ok := rule.(map[string]interface{}); ok {
					check(sub, value, join(at, prop), problems)
				} else if rule == false {
					fail("additional property %q is not allowed", prop)
				}
			}
		case "required":
			for _, prop := range rule.([]interface{}) {
				if _, ok := m[prop.(string)]; isMap && !ok {
					fail("%s is required", prop)
				}
			}
		case "items":
			for i, item := range list {
				check(rule.(map[string]interface{}), item, join(at, fmt.Sprint(i)), problems)
			}
		case "minItems":
			if isList && float64(len(list)) < rule.(float64) {
				fail("array must have at least %v items", rule)
			}
		case "enum":
			found := false
			for _, option := range rule.([]interface{}) {
				found = found || reflect.DeepEqual(option, v)
			}
			if !found {
				fail("must be one of %v", rule)
			}
		case "not":
			var sub []string
			check(rule.(map[string]interface{}), v, at, &sub)
			if len(sub) == 0 {
				fail("must not match %s", toJSON(rule))
			}
		case "minimum":
			if isNumber && n < rule.(float64) {
				fail("must be greater than or equal to %v", rule)
			}
		case "maximum":
			if isNumber && n > rule.(float64) {
				fail("must be less than or equal to %v", rule)
			}
		case "exclusiveMinimum":
			if isNumber && n <= rule.(float64) {
				fail("must be greater than %v", rule)
			}
		case "minLength":
			if isString && float64(len([]rune(s))) < rule.(float64) {
				fail("string length must be greater than or equal to %v", rule)
			}
		case "pattern":
			if isString && !regexp.MustCompile(rule.(string)).MatchString(s) {
				fail("does not match pattern %q", rule)
			}
		default:
			fail("the schema uses %q, which this renderer does not check", key)
		}
	}
}

func join(at, key string) string {
	if at == "" {
		return key
	}
	return at + "." + key
}

func jsonType(v interface{}) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case float64:
		if x == math.Trunc(x) {
			return "integer"
		}
		return "number"
	case []interface{}:
		return "array"
	case map[string]interface{}:
		return "object"
	}
	return fmt.Sprintf("%T", v)
}
